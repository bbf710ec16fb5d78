"""The exercises: for each stage, the functions a learner writes, and what each must do.

A task names functions of one file of a stage package. `python -m common.exercises start N` copies
the stage into a workspace and replaces their bodies by `raise NotImplementedError(<hint>)`; the
task's tests (tests/exercises/stageN.py, marked `@pytest.mark.task("N.name")`) then fail until the
learner writes them. The hints say what a function receives and returns and the invariant it keeps;
the README section explains why. `needs`: tasks whose functions this task's tests also call (write
those first). The order of the list is the order to write them in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    id: str  # "6.match_prefix": the stage number, a dot, a name
    file: str  # relative to the stage package, e.g. "radix_cache.py"
    symbols: dict  # "Class.method" or "function" -> its hint
    goal: str  # one line
    readme: str  # the heading of the README section that explains the idea
    needs: tuple[str, ...] = ()

    @property
    def stage(self) -> int:
        return int(self.id.split(".")[0])

    @property
    def name(self) -> str:
        return self.id.split(".", 1)[1]


TASKS = [
    # ------------------------------------------------ stage 1: prefill, decode, the KV cache
    Task("1.complete_one", "core.py",
         goal="record one forward pass in a request's bookkeeping", readme="Follow one request",
         symbols={"Req.complete_one":
                   "called once per forward pass with the token it sampled: what the pass fed "
                   "(positions cached_len .. device_len-1) is now cached, the token joins "
                   "output_ids, and the next pass feeds exactly that one token (extend_len == 1). "
                   "Returns nothing."}),
    Task("1.causal_attention", "layers.py",
         goal="attention of the new tokens over the cache, causal", readme="Follow one request",
         symbols={"causal_attention":
                   "receives q [T, H, D] for the T new tokens and k, v [S, KVH, D] for all S "
                   "cached tokens, the new ones last; returns softmax(q k^T / sqrt(D)) v, [T, H, "
                   "D]. Query t (at position S-T+t) sees keys 0 .. S-T+t, never a later one. GQA: "
                   "each K/V head serves H // KVH query heads."}),
    Task("1.kv_cache_append", "kv_cache.py",
         goal="append a pass's K/V to the preallocated cache, in place",
         readme="The KV cache, and why preallocate",
         needs=("1.causal_attention",),
         symbols={"StaticKVCache.update":
                   "receives layer_id and this pass's k, v [T, KVH, D]; writes them in place at "
                   "rows seq_len .. seq_len+T-1 of that layer and returns (k_all, v_all) "
                   "[seq_len+T, KVH, D], views, not copies. seq_len advances once per pass, after "
                   "the last layer wrote (every layer of a pass writes at the same rows). More "
                   "rows than max_len: RuntimeError('KV cache full ...')."}),
    Task("1.decode_loop", "engine.py",
         goal="prefill once, then decode one token per pass until a stop condition",
         readme="Follow one request",
         needs=("1.complete_one", "1.kv_cache_append", "1.causal_attention"),
         symbols={"Engine.generate":
                   "receives a new Req; returns it finished. Check the prompt fits, make a KV "
                   "cache (new_kv_cache), prefill once, then loop: sample (sampler.sample, with a "
                   "torch.Generator seeded by sampling_params.seed if set), req.complete_one, "
                   "check_stop, decode_one_token. Every pass feeds req.next_input_ids(), never a "
                   "token twice."}),
    # ------------------------------------------------ stage 2: batching, padded vs packed
    Task("2.varlen_metadata", "engine.py",
         goal="pack a batch into one row with the varlen metadata attention needs",
         readme="Padded vs packed",
         symbols={"Engine.prepare":
                   "receives a Batch and its BatchKVCache; returns the ForwardBatch: every "
                   "request's next_input_ids() packed into one [N] row, their positions "
                   "(cached_len onwards), the slot of each token, cu_seqlens [B+1] int32 (request "
                   "b is rows cu[b]..cu[b+1]-1), max_seqlen, seq_lens (device_len) and "
                   "last_token_indices (each request's last real token). pad_to_longest: every "
                   "request takes max(extend_len) rows, pads (token 0) after its real tokens."}),
    Task("2.padding_mask", "attention/torch_backend.py",
         goal="decode attention over per-request cache rows, masking past each length",
         readme="Attention backends",
         symbols={"TorchBackend.decode":
                   "receives q [B, H, D] (one query per request), k_cache, v_cache [num_slots, "
                   "max_len, KVH, D], slot_ids [B] and seq_lens [B]; returns [B, H, D]. Request b "
                   "attends to k_cache[slot_ids[b], :seq_lens[b]] only: rows are as long as the "
                   "longest request, so mask every key at or past its own length (what lies there "
                   "is stale)."}),
    Task("2.varlen_prefill", "attention/torch_backend.py",
         goal="causal attention within each packed prompt, never across",
         readme="Attention backends",
         symbols={"TorchBackend.prefill":
                   "receives q [N, H, D], k, v [N, KVH, D] of B prompts packed one after another, "
                   "and cu_seqlens [B+1]; returns [N, H, D]: causal attention inside each "
                   "request's slice cu[b]..cu[b+1]-1, never across requests (one request's tokens "
                   "must not change another's output)."}),
    Task("2.batched_sampling", "sampler.py",
         goal="per-request temperature, top-k, top-p and seeds, for a whole batch at once",
         readme="Sampling per request",
         symbols={"sample":
                   "receives logits [B, vocab], one SamplingParams and one torch.Generator (or "
                   "None) per row; returns B token ids. Greedy rows (is_greedy) take the argmax; "
                   "the others divide by their temperature, keep their top_k tokens and the "
                   "smallest top-p prefix of the sorted probabilities (the top token always "
                   "survives), and draw from what is left with their own generator, so a seeded "
                   "row draws the same token in any batch."}),
    # ------------------------------------------------ stage 3: layers and weights
    Task("3.merged_linear_loader", "layers.py",
         goal="load q/k/v (or gate/up) checkpoint tensors into one stacked weight",
         readme="Merged linears",
         symbols={"MergedLinear.weight_loader":
                   "receives the stacked parameter (weight or bias), one checkpoint part and its "
                   "shard_id ('q'/'k'/'v' or 0/1); copies the part into its rows "
                   "(shard_offsets[shard_id] = (first row, rows)) with copy_into, which checks the "
                   "shape. An unknown shard_id: ValueError naming it."}),
    Task("3.rope_scaling", "layers.py",
         goal="RoPE frequencies, with linear and llama3 scaling for long context",
         readme="`config.json` → `ModelConfig`",
         symbols={"rope_inv_freq":
                   "receives head_dim, theta and a RopeScaling; returns float32 [D/2] rotation "
                   "speeds 1 / theta^(2i/D) (transformers' formulas exactly). 'linear' divides all "
                   "by factor; 'llama3' keeps pairs whose wavelength 2*pi/inv_freq is below "
                   "orig/high_freq_factor, divides those above orig/low_freq_factor by factor, and "
                   "blends linearly (in orig/wavelen) in between."}),
    Task("3.rope", "layers.py",
         goal="rotary position embedding of q and k", readme="One decoder, four families",
         needs=("3.rope_scaling",),
         symbols={"RotaryEmbedding.forward":
                   "receives positions [N] and q [N, H, D], k [N, KVH, D]; returns both rotated: "
                   "each pair (x_i, x_{i+D/2}) turns by the angle position * inv_freq[i]. Angles "
                   "in float32 (self.inv_freq), cos/sin cast to q's dtype. A position-0 token is "
                   "unchanged, and q.k then depends only on the distance between two positions."}),
    Task("3.name_mapping", "weights.py",
         goal="map checkpoint names onto merged parameters and list what must be loaded",
         readme="The loader (`weights.py`)",
         needs=("3.merged_linear_loader", "3.rope_scaling"),
         symbols={"map_name":
                   "receives the model and a checkpoint tensor name; returns (our parameter name, "
                   "shard_id) using model.stacked_params_mapping, a list of (param fragment, "
                   "checkpoint fragment, shard_id): '...k_proj.weight' -> ('...qkv_proj.weight', "
                   "'k'). Any other name: (itself, None).",
                  "expected_pieces":
                   "receives the model; returns {(parameter name, shard_id): checkpoint name} for "
                   "every piece the checkpoint must provide: a stacked parameter needs one per "
                   "shard, any other parameter one piece with shard_id None. The loader refuses a "
                   "checkpoint that misses one."}),
    # ------------------------------------------------ stage 4: pages, admission, preemption
    Task("4.page_allocation", "scheduler/cache_manager.py",
         goal="hand out KV pages and map positions to pool slots",
         readme="4.1 Pages: the KV pool, the page table, the cache manager (core)",
         symbols={"CacheManager.grow":
                   "receives a request holding a page-table row and a token count; gives it pages "
                   "from free_pages (pop()) until it can hold num_tokens, records them in "
                   "req_pages[rid] and the page table (page_table.write). All or nothing: not "
                   "enough free pages -> False, nothing changed.",
                  "CacheManager.slots":
                   "receives a request and positions start..end-1; returns their pool slots page * "
                   "page_size + offset, where position p lives in the request's page p // "
                   "page_size at offset p % page_size."}),
    Task("4.kv_indices", "attention/torch_backend.py",
         goal="read each request's keys through the page table",
         readme="4.2 Attention that reads K/V through the page table (core)",
         needs=("4.page_allocation",),
         symbols={"build_kv_indices":
                   "receives a ForwardBatch; returns (kv_indptr [B+1] host list of prefix sums of "
                   "seq_lens_cpu, kv_indices [sum(seq_lens)] int64): the pool slot of every key of "
                   "every request, in order, read through the page table: request b's key p is "
                   "page_table[req_rows[b], p // page_size] * page_size + p % page_size."}),
    Task("4.prefill_adder", "scheduler/prefill.py",
         goal="admit waiting requests into a prefill batch within token and page budgets",
         readme="4.4 Admission: prefill batches, chunked prefill, decode and preemption (core)",
         needs=("4.page_allocation",),
         symbols={"PrefillAdder.build":
                   "receives the chunked request (or None), the waiting requests in priority "
                   "order, the running ones, new_token_ratio, max_context_len; returns "
                   "(Batch(reqs, 'prefill', out_cache_loc) or None, the waiting requests "
                   "admitted). The chunked request goes first; stop at the first request that does "
                   "not fit (no free row, max_prefill_tokens, or pages: its tokens plus, once its "
                   "prompt completes, future_tokens, after reserved_pages for the running). Cut "
                   "the request that crosses chunked_prefill_size (set_chunk). Admitted: "
                   "acquire_row, RUNNING, grow."}),
    Task("4.preemption", "scheduler/decode.py",
         goal="give every running request its next slot, preempting when the pool is dry",
         readme="4.4 Admission: prefill batches, chunked prefill, decode and preemption (core)",
         needs=("4.page_allocation", "4.kv_indices", "4.prefill_adder"),
         symbols={"DecodeManager.build":
                   "receives victim_order (a sort key: the smallest is evicted first); returns "
                   "(Batch(running, 'decode', out_cache_loc) or None, the preempted requests). "
                   "Every running request must grow to hold device_len tokens; while one cannot, "
                   "evict the first by victim_order: take it out of running, release its pages, "
                   "reset_for_recompute. No produced token is lost."}),
    # ------------------------------------------------ stage 5: CUDA graphs, overlap
    Task("5.graph_buckets", "graph.py",
         goal="choose the batch sizes to capture and the bucket a batch replays in",
         readme="5.1 CUDA graphs (core)",
         symbols={"bucket_sizes":
                   "receives max_bs; returns the batch sizes to capture: 1, 2, 4, 8, then every "
                   "multiple of 8 up to max_bs, and max_bs itself always last. max_bs < 1: "
                   "ValueError.",
                  "pick_bucket":
                   "receives the sorted buckets and a batch size; returns the smallest bucket that "
                   "holds it. Larger than the last bucket: ValueError."}),
    Task("5.overlap_results", "scheduler/output_processor.py",
         goal="read a step's tokens one step late: placeholders, stops, deferred frees",
         readme="5.2 Future tokens: a step split into launch and results (core)",
         symbols={"process_batch_result":
                   "receives the scheduler and a launched step (batch, sampled: (req, index in "
                   "output_ids) pairs, pending) and returns its StepOutputs. pending.wait() gives "
                   "the tokens; skip requests already finished; put each token at its index (it "
                   "replaces a placeholder), check_finished(scheduler, req, token, index + 1); a "
                   "request finished here drops the tokens launched after (output_ids, device_len, "
                   "cached_len). Then remove_finished, and release the deferred requests no "
                   "inflight batch holds."}),
    Task("5.graph_padding", "graph.py",
         goal="copy a batch into the graph's static buffers and pad it to its bucket",
         readme="5.1 CUDA graphs (core)",
         needs=("5.graph_buckets", "5.overlap_results"),
         symbols={"GraphRunner.load_inputs":
                   "receives a decode ForwardBatch of B requests; returns the bucket bs it replays "
                   "in. Copies input_ids, positions, out_cache_loc, req_rows, seq_lens into the "
                   "first B entries of the static buffers with copy_ (a graph reads fixed "
                   "addresses: never rebind them), and pads rows B..bs-1: token 0, position 0, row "
                   "0, seq_len 1, K/V into self.dummy_slot."}),
    # ------------------------------------------------ stage 6: the radix cache
    Task("6.insert_split", "radix_cache.py",
         goal="insert a sequence, splitting a node where it diverges", readme="The tree",
         symbols={"RadixCache.insert":
                   "receives token ids and their KV slots (1-D int tensor, same length); caches "
                   "the page-aligned prefix and returns how many leading tokens were already "
                   "cached (the caller frees those duplicate slots). Walk from the root, splitting "
                   "a node where the key diverges inside it; the rest becomes one new unlocked "
                   "leaf (value cloned). Keep evictable_size and the leaf set right "
                   "(_update_leaf_status).",
                  "RadixCache._split":
                   "receives a node and n (a page multiple inside it); returns a new upper node "
                   "holding the first n tokens/slots, between node and its parent, with the same "
                   "lock_ref and access time; node keeps the rest. Both dicts re-keyed by first "
                   "token (or first page)."}),
    Task("6.match_prefix", "radix_cache.py",
         goal="find the longest cached prefix of a prompt and its KV slots", readme="The tree",
         needs=("6.insert_split",),
         symbols={"RadixCache.match_prefix":
                   "receives token ids; returns MatchResult(indices: the KV slots of the longest "
                   "cached page-aligned prefix, last_node: the node where it ends, the root if "
                   "none). A match ending inside a node splits it there (_split), so it ends on a "
                   "node boundary. Every node on the path gets the access time of this match "
                   "(_touch with one _tick())."}),
    Task("6.lock_ref", "radix_cache.py",
         goal="protect the prefixes running requests read from eviction",
         readme="A request's life, with the cache",
         needs=("6.insert_split",),
         symbols={"RadixCache.inc_lock_ref":
                   "receives a node; adds 1 to lock_ref of it and every ancestor below the root. A "
                   "node going 0 -> 1 moves its tokens from evictable_size to protected_size and "
                   "stops being an evictable leaf. Returns the change of evictable_size (<= 0).",
                  "RadixCache.dec_lock_ref":
                   "undoes one inc_lock_ref(node) (1 -> 0 moves tokens back to evictable); returns "
                   "the change (>= 0). An unlocked node on the path: RuntimeError (unbalanced)."}),
    Task("6.evict", "radix_cache.py",
         goal="free cached tokens, least recently used leaves first", readme="The tree",
         needs=("6.insert_split", "6.lock_ref"),
         symbols={"RadixCache.evict":
                   "receives num_tokens (>= 0, else ValueError); removes unlocked leaves, least "
                   "recently used first (_pop_lru_leaf), until at least num_tokens are gone or "
                   "none is left; a parent left childless and unlocked becomes evictable in turn "
                   "(_update_leaf_status). Returns the freed KV slots (int64), for the caller's "
                   "allocator."}),
    Task("6.fork_beam", "beam_search.py",
         goal="one round of beam search: keep the k best (beam, token) pairs, finish the stopped",
         readme="6.6 Beam search: beams that share prefix pages (optional)",
         symbols={"BeamState.advance":
                   "receives top: for each live beam i (self.running[i] = (tokens, float32 "
                   "score)), the log-probabilities and token ids of its top_n best next tokens. "
                   "Candidates: score_i + log p, in float32, best first, the top_n best over all "
                   "beams. Those that do not stop (a stop id, or t + 1 == max_new_tokens) fork: "
                   "the first beam_width become self.running. A stopping candidate among the first "
                   "beam_width joins self.finished as (score / (t + 1) ** length_penalty, tokens, "
                   "score, 'stop' or 'length'), unless early_stopping is True and k are finished "
                   "already; keep the k best. Then set improvable (the best live beam, scored at t "
                   "+ 1 tokens, or at max_new_tokens under 'never' with a positive penalty, beats "
                   "the worst of k finished; sticky) and done (all stopped, not improvable, or k "
                   "finished under early_stopping True)."}),
    # ------------------------------------------------ stage 7: tensor parallelism
    Task("7.column_parallel", "layers.py",
         goal="load this rank's output rows of column-parallel weights",
         readme="What is split, and what is communicated",
         symbols={"ColumnParallelLinear.weight_loader":
                   "receives this rank's parameter and the full checkpoint tensor; copies rows "
                   "[rank * rows, (rank+1) * rows) of it (take_shard along dim 0, which checks the "
                   "full size). A shard_id: ValueError.",
                  "MergedColumnParallelLinear.weight_loader":
                   "receives one part (shard_id) of a merged weight; shard_offsets[shard_id] = "
                   "(first local row, local rows, which slice of the part); copies that slice of "
                   "the part (full length local * full_rows(shard_id)) into the local rows."}),
    Task("7.row_parallel", "layers.py",
         goal="split a linear by input columns and sum the partial products",
         readme="What is split, and what is communicated",
         symbols={"RowParallelLinear.weight_loader":
                   "receives the full checkpoint weight [out, in]; copies this rank's input "
                   "columns [rank * cols, (rank+1) * cols) (take_shard along dim 1).",
                  "RowParallelLinear.forward":
                   "receives x [N, in / tp], this rank's slice of the input; returns [N, out]: the "
                   "partial product x W_rank^T summed over the ranks (tp.all_reduce), then the "
                   "bias, added once."}),
    Task("7.vocab_parallel", "layers.py",
         goal="split the embedding by vocabulary and assemble the rows",
         readme="What is split, and what is communicated",
         symbols={"VocabParallelEmbedding.weight_loader":
                   "receives the full [vocab, hidden] matrix; copies rows start .. start+rows-1 "
                   "that exist (the last rank may be short: zero its padding rows).",
                  "VocabParallelEmbedding.forward":
                   "receives input_ids [N]; returns [N, hidden]. With tp.size == 1 a plain lookup; "
                   "else look up the ids in [start, start+rows) from the local rows, zeros for the "
                   "others, and tp.all_reduce assembles every row."}),
    # ------------------------------------------------ stage 8: the server
    Task("8.incremental_detokenizer", "detokenizer.py",
         goal="turn tokens into text one at a time, never splitting a character",
         readme="Why detokenization has a process of its own",
         symbols={"IncrementalDetokenizer.add":
                   "receives one token id; returns the stop string it completed, or None. Decode "
                   "the window ids[prefix_offset:] minus ids[prefix_offset:read_offset]; only when "
                   "that adds text not ending in U+FFFD (a character cut in half) append it to "
                   "self.text and move the window (prefix_offset, read_offset = read_offset, "
                   "len(ids)), then search the new text for a stop (_find_stop, from where the old "
                   "text ended)."}),
    Task("8.stop_hold_back", "detokenizer.py",
         goal="stream text deltas without leaking the start of a stop string",
         readme="Stop strings: checked in the scheduler, trimmed in the detokenizer",
         needs=("8.incremental_detokenizer",),
         symbols={"IncrementalDetokenizer._held_back":
                   "returns how many characters at the end of self.text could be the start of a "
                   "stop string (the longest such tail, shorter than the stop): not safe to stream "
                   "yet.",
                  "IncrementalDetokenizer.take_delta":
                   "returns the text not handed out yet (from self.sent), holding back "
                   "_held_back() characters unless final. final: first flush a window cut inside a "
                   "character (it shows as U+FFFD), unless a stop string matched. sent never moves "
                   "backwards."}),
    Task("8.detokenizer_worker", "server/detokenizer_worker.py",
         goal="per-request decoding state in the detokenizer process",
         readme="Why detokenization has a process of its own",
         needs=("8.incremental_detokenizer", "8.stop_hold_back"),
         symbols={"DetokenizerWorker.detokenize":
                   "receives one ReqOutput (token ids of one step of one request); returns it with "
                   ".text set to that step's text delta. Keeps one IncrementalDetokenizer per rid "
                   "(made with the request's stop strings at its first output), freed when it "
                   "finishes; an abort or error output frees it and passes through. Fills each "
                   "logprob's text and top_texts (token_text)."}),
    Task("8.sse_chunks", "server/openai_serving.py",
         goal="the OpenAI stream: one request's outputs as chat.completion.chunk events",
         readme="Server-sent events",
         symbols={"ChatBuilder.stream_chunks":
                   "receives a choice index and one ReqOutput; returns the chat.completion.chunk "
                   "bodies it makes (after self.add). The first output of a choice opens with a "
                   "delta {'role': 'assistant', 'content': ''}; text (or logprobs, when asked) "
                   "makes a {'content': text} delta; the finished output ends with an empty delta "
                   "carrying finish_reason and matched_stop. Every chunk: 'index', 'delta', "
                   "'logprobs', 'finish_reason' (self.chunk)."}),
    # ------------------------------------------------ stage 9: mixture of experts
    Task("9.topk_routing", "moe.py",
         goal="route each token to its top-k experts", readme="Routing",
         symbols={"TopK.forward":
                   "receives router_logits [N, E]; returns TopKOutput(topk_weights [N, k], "
                   "topk_ids [N, k], router_logits): softmax over the experts in float32, the "
                   "top_k largest (best first), renormalised to sum to 1 if self.renormalize, cast "
                   "to the logits' dtype if self.weights_in_logits_dtype."}),
    Task("9.moe_align_block_size", "moe.py",
         goal="sort token slots by expert into GEMM blocks, without a host sync",
         readme="Two paths: the reference loop and the fused kernels",
         symbols={"moe_align_block_size":
                   "receives topk_ids [M, k] (slot s = t*k + j), block_size, num_experts; returns "
                   "sorted_token_ids [EM] int32 (slots grouped by expert, in slot order, each "
                   "expert's run padded with the invalid id M*k to a multiple of block_size), "
                   "expert_ids [EM / block_size] int32 (the expert of each block) and "
                   "num_tokens_post_padded [1] int32. EM is an upper bound known without reading "
                   "the counts on the host: no .item(), no data-dependent shapes."}),
    Task("9.reference_experts", "moe.py",
         goal="the mixture-of-experts layer as a loop over experts",
         readme="Two paths: the reference loop and the fused kernels",
         symbols={"reference_experts":
                   "receives x [M, H], w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I], "
                   "topk_weights and topk_ids [M, k]; returns [M, H]: out[t] = sum_j w[t, j] * "
                   "expert_{id[t, j]}(x[t]), expert_e(x) = W2_e (silu(gate_e x) * up_e x). One "
                   "expert at a time: gather its tokens, SwiGLU, index_add_ the weighted rows."}),
    Task("9.expert_weight_loader", "moe.py",
         goal="stack every expert's weights, each rank keeping its slice", readme="Loading experts",
         symbols={"FusedMoE.weight_loader":
                   "receives w13_weight or w2_weight, a checkpoint tensor and shard_id (expert id "
                   "or None for all, 'w1' gate | 'w3' up | 'w13' both | 'w2' down); refuses a "
                   "shape other than checkpoint_shape(shard_id) (ValueError). Copies this rank's "
                   "slice [rank * Ip, (rank+1) * Ip) of the intermediate dim: gate rows to "
                   "w13[..., :Ip, :], up rows to w13[..., Ip:, :], down columns to w2."}),
    Task("9.accept_draft", "speculative/verify.py",
         goal="the greedy accept rule: the longest matching prefix, then the target's own token",
         readme="9.11 Speculative decoding: draft, verify, accept (optional)",
         symbols={"accept_draft":
                   "receives draft (k token ids) and target (k + 1 ids: target[j] is the target's "
                   "argmax after the drafts before j); returns the drafts up to the first one that "
                   "differs from target, followed by the target's token at that position (after "
                   "all k drafts: target[k]). Always at least one token."}),
    Task("9.dequantize_q4_1", "quantization.py",
         goal="unpack llama.cpp's Q4_1 blocks into float32 weights",
         readme="9.8 Quantized weights: GGUF's Q4_1/Q8_0 blocks kept in memory, int8 (optional)",
         symbols={"dequantize_q4_1":
                   "receives data, uint8 [out, nb * 20]: each row is nb blocks of 20 bytes, "
                   "| d fp16 | m fp16 | 16 bytes |, little-endian; byte j holds weight j in its low "
                   "nibble and weight j + 16 in its high one. Returns float32 [out, nb * 32], "
                   "weight = q * d + m computed in float32 (the product rounded, then the sum)."}),
]

BY_ID = {task.id: task for task in TASKS}
