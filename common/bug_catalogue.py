"""The bug catalogue: per bug, the symptom a user reports, the planted change, the diagnosis, the
check. See common/bug_hunts.py for the commands.

A bug's id names its symptom, never its cause: `bugs` shows the ids, and the hunt is to find the
cause. `search` must occur exactly once in the reference file (a test fails loudly, "pattern not
found in stageN_x/FILE", when the stage changes under it). `checks` are pytest node ids that fail
with the bug and pass on the reference; `probe` names a function of common/bug_probes.py that shows
the symptom; `guide` the TROUBLESHOOTING.md section that covers it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    id: str  # "1.static_cache_disagrees": the stage number, a dot, the symptom in a few words
    file: str  # relative to the stage package
    search: str  # exact text of the reference file, found once
    replace: str  # what the planted copy has instead
    symptom: str  # as a user would report it
    hints: tuple[str, ...]  # the diagnosis, one step per `hint`
    checks: tuple[str, ...]  # pytest node ids
    probe: str  # function name in common/bug_probes.py
    guide: str  # TROUBLESHOOTING.md section heading (its anchor text)

    @property
    def stage(self) -> int:
        return int(self.id.split(".")[0])


E = "tests/exercises/stage{}.py::{}".format
B = "tests/bugs/bugs_stage{}.py::{}".format
CHANGES = "Results that change between runs, or with the batch"
GIBBERISH = "Garbled output"
NEVER_STOPS = "Generation that never stops"
LEAKS = "Pages that leak after aborts"
OOM = "Out of memory"

BUGS = [
    # ------------------------------------------------------------ stage 1
    Bug("1.static_cache_disagrees", "kv_cache.py",
        "self._len += T  # the last layer", "self._len += T - 1  # the last layer",
        symptom="With the default KV cache the model writes different text than with "
                "kv_cache='growing', and it soon repeats itself; the first token is right.",
        hints=("Turn the cache's kind over: Engine(path, kv_cache='growing') against the default "
               "'static' on the same prompt, greedy. The first token agrees, later ones do not: "
               "the prefill is right, the decode steps read a wrong cache.",
               "Print cache.seq_len after the prefill and after each decode step of a "
               "StaticKVCache "
               "(or run tests/exercises/stage1.py -k static_cache). It must grow by T per pass.",
               "Read StaticKVCache.update: where does the next pass write, and when does the "
               "counter move? Every pass must land after the rows already filled."),
        checks=(E(1, "test_static_cache_appends_in_place_and_returns_views"),
                E(1, "test_the_model_reads_the_static_cache_as_the_growing_one")),
        probe="static_vs_growing", guide=CHANGES),
    Bug("1.wrong_from_the_first_token", "layers.py",
        ".tril(diagonal=S - T)", ".tril(diagonal=S - T + 1)",
        symptom="The answers differ from Hugging Face transformers' on the same checkpoint from "
                "the very first generated token, greedy, float32; nothing crashes.",
        hints=("Compare against the reference at the first step: the golden comparison "
               "(`python -m common.diagnose golden 1 --copy`) names the first diverging step; step "
               "0 means the prefill itself is wrong.",
               "Feed the same ids to the model twice, changing only the last token: the logits of "
               "the earlier positions must not move (a position never sees a later one).",
               "Read causal_attention's mask: query t of T new tokens sits at position S-T+t and "
               "may see keys 0 .. S-T+t. Print the mask for T = S = 4."),
        checks=(E(1, "test_causal_attention_matches_the_definition"),
                E(1, "test_causal_attention_never_reads_a_later_key")),
        probe="first_logits_vs_transformers", guide=GIBBERISH),
    Bug("1.never_stops", "engine.py",
        "not params.ignore_eos):", "params.ignore_eos):",
        symptom="Every answer runs to max_new_tokens: the model writes its end-of-text token and "
                "goes on talking after it.",
        hints=("Look at the finish reasons: req.finish_reason is 'length' everywhere, and the "
               "end-of-text id (engine.eos_token_ids) does appear in req.output_ids.",
               "So the id is known and generated: the stop check does not act on it. Try "
               "ignore_eos=True: does the request now stop?",
               "Read Engine.check_stop: when must an EOS id finish the request?"),
        checks=(B(1, "test_generation_stops_at_eos"),),
        probe="eos_ignored", guide=NEVER_STOPS),
    # ------------------------------------------------------------ stage 2
    Bug("2.batch_changes_answers", "attention/torch_backend.py",
        "< seq_lens[:, None]  # [B, max_len]", "<= seq_lens[:, None]  # [B, max_len]",
        symptom="With attention_backend='torch', a prompt run alone gives one answer and the same "
                "prompt batched with longer prompts another, greedy; the longest prompt of a batch "
                "is always right.",
        hints=("Find the smallest batch that shows it: one short prompt with one long one. The "
               "short one changes from its first decoded token on, the prefill token is right: "
               "suspect decode attention.",
               "Switch the backend (attention_backend='triton' runs on the CPU too, in Triton's "
               "interpreter): if the answers agree there, the torch backend's decode is the cause.",
               "Read TorchBackend.decode: every row of the batch is max_len keys long. Which keys "
               "may request b see? Count them for seq_len 3 in a batch whose longest is 7."),
        checks=(E(2, "test_decode_ignores_what_lies_past_a_request_length"),
                E(2, "test_decode_attends_to_each_request_own_keys_only")),
        probe="alone_vs_batched", guide=CHANGES),
    Bug("2.sampling_ignored_in_a_batch", "sampler.py",
        "if all(p.is_greedy for p in params):", "if any(p.is_greedy for p in params):",
        symptom="Requests with temperature=1.0 and different seeds all give the same, repetitive "
                "greedy answer, but only when a greedy request shares their batch.",
        hints=("Run the sampled requests alone, then with one greedy request (temperature=0) in "
               "the same generate call. Alone they differ by seed; together they are all the "
               "greedy text.",
               "The sampler decides per batch before it decides per row: print which path "
               "sample() takes for the mixed batch.",
               "Read sample()'s fast path: when is skipping the softmax, sort and noise allowed?"),
        checks=(E(2, "test_a_seeded_row_draws_the_same_token_in_any_batch"),),
        probe="sampled_rows_turn_greedy", guide="Repetition"),
    # ------------------------------------------------------------ stage 3
    Bug("3.never_stops_on_end_of_turn", "tokenizer.py",
        "else (eos or []))", "else [])",
        symptom="A Llama-3.1-style chat model never stops: it writes its end-of-turn token and "
                "goes on; models with one EOS id in config.json are fine.",
        hints=("Print llm.tokenizer.eos_token_ids and compare with the checkpoint's "
               "generation_config.json: Llama-3.1 Instruct lists three ids there.",
               "Which of the three files (config.json, generation_config.json, the tokenizer's "
               "eos_token) did each id come from? One form of eos_token_id is dropped.",
               "Read read_eos_token_ids: eos_token_id may be one int or a list."),
        checks=(B(3, "test_eos_ids_are_read_from_every_source_and_form"),),
        probe="end_of_turn_list_ignored", guide=NEVER_STOPS),
    Bug("3.bfloat16_drifts", "layers.py",
        "        dtype = x.dtype\n        x = x.float()\n", "        dtype = x.dtype\n",
        symptom="In bfloat16 the answers leave float32's a few tokens earlier than transformers' "
                "own bfloat16 run does; float32 matches the reference exactly.",
        hints=("float32 is right, so the arithmetic is right: look for a step computed in the "
               "wrong precision. Compare one layer's output in bfloat16 with transformers' "
               "module of the same name on the same input.",
               "Go through the layer's parts (norm, attention, MLP) on one random input in "
               "bfloat16 and compare each with transformers': the one that differs is the cause.",
               "Transformers computes some reductions in float32 even in a bfloat16 model. Which "
               "of our modules' docstrings promise that, and does the code keep the promise?"),
        checks=(B(3, "test_rmsnorm_in_bfloat16_equals_transformers"),),
        probe="bf16_norm_vs_transformers", guide="bfloat16 output that drifts from float32"),
    Bug("3.gibberish_after_loading", "layers.py",
        '"k": num_kv_heads * head_dim,\n                                       "v": num_kv_heads',
        '"v": num_kv_heads * head_dim,\n                                       "k": num_kv_heads',
        symptom="The checkpoint loads without a warning, and every answer is fluent-looking "
                "nonsense from the first token.",
        hints=("Compare the logits of one prompt with transformers': they differ at step 0, by a "
               "lot (not a rounding difference). Something in the model or its weights is wrong.",
               "Compare the loaded parameters with the checkpoint's tensors (safetensors' "
               "safe_open): the merged qkv_proj should be [q_proj; k_proj; v_proj] row by row.",
               "Read MergedLinear.weight_loader and how QKVLinear declares its parts: where does "
               "each shard land, and where does forward() split them?"),
        checks=(E(3, "test_qkv_parts_land_in_their_rows"),),
        probe="logits_vs_transformers_stage3", guide=GIBBERISH),
    # ------------------------------------------------------------ stage 4
    Bug("4.preempts_under_load", "scheduler/prefill.py",
        "r.cached_len + expected)", "r.cached_len + 1)",
        symptom="Under load, requests keep being preempted and recomputed: throughput collapses "
                "and the log's #preempted grows, although each request alone fits easily.",
        hints=("Count preemptions: llm.scheduler.total_preemptions after a run of many requests "
               "with long max_new_tokens on a small pool (max_total_tokens=256).",
               "Preemption means admission promised pages that decoding then needed. Print, at "
               "each prefill, PrefillAdder.reserved_pages(running, ...) next to what the running "
               "requests go on to use.",
               "Read reserved_pages: a running request is expected to grow by new_token_ratio of "
               "its remaining budget. Is that growth counted?"),
        checks=(E(4, "test_adder_reserves_pages_for_the_running_by_new_token_ratio"),),
        probe="preemption_storm", guide=OOM),
    Bug("4.cancelled_requests_leak", "scheduler/output_processor.py",
        "    if req.table_idx >= 0:\n        scheduler.cache.release(req)",
        '    if req.table_idx >= 0 and reason != "abort":\n        scheduler.cache.release(req)',
        symptom="The engine's memory fills up with every cancelled request (a client that stops "
                "reading the stream); finished requests are fine. After enough cancels new "
                "requests wait forever.",
        hints=("Cancel a stream (break out of llm.stream(...)), then print "
               "llm.scheduler.cache.num_used_pages: with nothing running it must be 0.",
               "Run llm.scheduler.check_integrity(): it names the pages held by no running "
               "request.",
               "Follow abort(): Scheduler.abort -> finish_request. Where do the pages go back?"),
        checks=(B(4, "test_aborted_requests_give_every_page_back"),),
        probe="abort_leaks_pages", guide=LEAKS),
    Bug("4.stream_shows_replacement_chars", "detokenizer.py",
        'if len(full_text) > len(prefix_text) and not full_text.endswith("\\ufffd"):',
        "if len(full_text) > len(prefix_text):",
        symptom="Streamed Chinese text and emoji come out with '�' in them, and the final text "
                "is not what tokenizer.decode gives for the same ids.",
        hints=("Round-trip the text: tokenizer.decode(tokenizer.encode(text)) == text? If yes, "
               "the tokenizer is fine and the incremental decoding is not.",
               "Feed the ids one at a time to IncrementalDetokenizer.add and print .text after "
               "each: where does the first '�' appear? (One Chinese character is often two or "
               "three byte-level tokens.)",
               "Read add(): when may decoded text be accepted and the window move on?"),
        checks=(B(4, "test_streamed_text_never_holds_half_a_character"),),
        probe="stream_has_replacement_chars", guide="A stream that stops mid-character"),
    # ------------------------------------------------------------ stage 5
    Bug("5.one_token_past_stop", "scheduler/output_processor.py",
        "len(req.output_ids) > index + 1:", "len(req.output_ids) > index + 2:",
        symptom="With overlap scheduling on (the default), a request that hits a stop token "
                "returns one more token after it; with disable_overlap=True it is fine.",
        hints=("Compare disable_overlap=True and False on a request with stop_token_ids: the "
               "overlapped one has one extra token after the stop token.",
               "The overlap loop launches step n+1 before reading step n's tokens: when step n "
               "says 'stop', step n+1's token for that request is already in output_ids.",
               "Read process_batch_result: what happens to the tokens launched after the one "
               "that finished the request?"),
        checks=(E(5, "test_the_loop_reads_each_step_tokens_and_stops"),),
        probe="overlap_runs_past_stop", guide=NEVER_STOPS),
    Bug("5.graphs_change_answers", "graph.py",
        "self.out_cache_loc[B:bs].fill_(self.dummy_slot)", "self.out_cache_loc[B:bs].fill_(0)",
        symptom="With CUDA graphs on, answers change when the number of running requests is not a "
                "bucket size (3, 5, 6, ...); disable_cuda_graph=True fixes it.",
        hints=("Turn the graphs off (disable_cuda_graph=True) and compare: same answers means the "
               "graph path is the cause. On a CPU, common/graph_emulator.py runs the same path.",
               "Try batch sizes 1, 2, 3, 4: only those padded up to a larger bucket go wrong.",
               "Padded rows run through the model too and write K/V somewhere. Read "
               "GraphRunner.load_inputs: where do the padded rows write?"),
        checks=(E(5, "test_load_inputs_copies_into_the_static_buffers_and_pads"),
                E(5, "test_emulated_graph_replays_give_the_eager_tokens")),
        probe="padded_graph_rows_corrupt", guide=CHANGES),
    # ------------------------------------------------------------ stage 6
    Bug("6.cache_never_frees", "scheduler/cache_manager.py",
        "        self.unlock(req)\n        del self.req_pages", "        del self.req_pages",
        symptom="With the radix cache on, memory fills up and stays full: after a few hundred "
                "different prompts new requests are refused or wait, with nothing running; "
                "disable_radix_cache=True is fine.",
        hints=("With nothing running, look at the tree: llm.scheduler.cache.tree.protected_size "
               "must be 0 (no request holds a prefix), evictable_size the rest.",
               "llm.scheduler.check_integrity() compares every node's lock_ref with the running "
               "requests that hold it.",
               "A prefix is locked at admission (CacheManager.lock). Follow a request to its end: "
               "who unlocks it?"),
        checks=(B(6, "test_finished_requests_leave_no_lock"),),
        probe="locks_never_released", guide=LEAKS),
    Bug("6.shared_prefix_garbage", "radix_cache.py",
        "if node.lock_ref == 0 and not node.children:", "if not node.children:",
        symptom="Under memory pressure, requests that share a long system prompt sometimes return "
                "garbage or fail an integrity check; disable_radix_cache=True, or a larger pool, "
                "fixes it.",
        hints=("Run with the radix cache off: if the answers are right, the tree is the cause. "
               "Then shrink the pool (max_total_tokens) until it fails: eviction is involved.",
               "Call llm.scheduler.check_integrity() after every step: a page both free and held "
               "by a running request means something was evicted while in use.",
               "Which nodes may evict() take? Read _update_leaf_status and the lock counts."),
        checks=(E(6, "test_evict_cascades_to_parents_but_never_takes_a_locked_node"),
                E(6, "test_locks_protect_the_whole_path")),
        probe="locked_prefix_evicted", guide=LEAKS),
    # ------------------------------------------------------------ stage 7
    Bug("7.tp2_gibberish", "layers.py",
        "take_shard(loaded, 1, self.tp.rank, cols,", "take_shard(loaded, 1, self.tp.size - 1 - "
        "self.tp.rank, cols,",
        symptom="With tp_size=2 every answer is nonsense; tp_size=1 is right. The ranks agree "
                "with each other, nothing hangs, no error.",
        hints=("tp 1 right, tp 2 wrong, ranks in step: the sharding is wrong, not the "
               "communication. Check layer by layer: each rank's partial output of one layer, "
               "summed (or joined), must equal the unsharded layer's.",
               "Compare each rank's loaded weights with the checkpoint's slices: rank r of a "
               "row-parallel layer holds input columns [r * in/tp, (r+1) * in/tp).",
               "Read RowParallelLinear.weight_loader: which columns does rank r take?"),
        checks=(E(7, "test_row_parallel_ranks_hold_their_input_columns"),
                E(7, "test_row_parallel_partial_sums_add_up_to_the_full_linear")),
        probe="row_parallel_wrong_half", guide="A tensor-parallel rank that diverges"),
    Bug("7.some_tokens_wrong_with_tp", "layers.py",
        "(local < self.rows)", "(local <= self.rows)",
        symptom="With tp_size=2 most prompts are right, but prompts holding certain tokens come "
                "out different from tp_size=1 (fine at tp 1).",
        hints=("Find a failing prompt and bisect it to the token that makes it fail. Its id sits "
               "exactly at a rank's boundary: vocab / tp.",
               "Look up that one id through VocabParallelEmbedding on each rank (what each "
               "contributes to the all-reduce): more than one rank adds a row.",
               "Read VocabParallelEmbedding.forward: which ids does a rank hold?"),
        checks=(E(7, "test_vocab_parallel_lookup_assembles_every_row"),),
        probe="boundary_token_embedded_twice", guide="A tensor-parallel rank that diverges"),
    # ------------------------------------------------------------ stage 8
    Bug("8.stop_string_missed", "detokenizer.py",
        "self.text.find(stop, max(0, searched - len(stop) + 1))",
        "self.text.find(stop, searched)",
        symptom="Stop strings work sometimes: the model writes straight past a stop string like "
                "'界!' or '\\n\\n' when it arrives split over two tokens.",
        hints=("Tokenize the stop string: several tokens? Then it can arrive in pieces, and the "
               "search must look across them.",
               "Feed the tokens to IncrementalDetokenizer.add one by one, with the stop string: "
               "after which token should add() return it, and does it?",
               "Read _find_stop: where does the search start, and can a stop string that began in "
               "text decoded earlier still be found?"),
        checks=(E(8, "test_a_stop_string_across_tokens_is_found_and_trimmed"),),
        probe="split_stop_string_missed", guide=NEVER_STOPS),
    Bug("8.detokenizer_memory_grows", "server/detokenizer_worker.py",
        "            self.states.pop(out.rid, None)\n            return out",
        "            return out",
        symptom="The server's memory grows with every cancelled request: the detokenizer process "
                "keeps growing while finished requests leave nothing behind.",
        hints=("/get_server_info shows the scheduler's state: if it is clean, the leak is in "
               "another process. Which processes keep per-request state?",
               "In-process: make a DetokenizerWorker, send it a request's first output, then an "
               "abort output, and print len(worker.states).",
               "Read DetokenizerWorker.detokenize: what happens to a request's state on each "
               "kind of last output?"),
        checks=(E(8, "test_worker_frees_an_aborted_request_and_names_logprob_tokens"),),
        probe="detokenizer_keeps_aborted_state", guide=LEAKS),
    Bug("8.json_runs_to_the_limit", "constrained.py",
        "any_whitespace=True,\n                                                max_whitespace_cnt=MAX_WHITESPACE)",
        "any_whitespace=True)",
        symptom="Requests with a json_schema often run to max_new_tokens: the answer is an "
                "opening brace followed by pages of spaces and newlines, and never parses.",
        hints=("The output follows the grammar (no error), so the grammar allows it. Check the "
               "grammar alone: python -m common.diagnose grammar 8 --copy.",
               "A complete object allows end-of-text, so the model could stop; what else does the "
               "grammar allow after '{', and how many times in a row?",
               "Read parse_grammar in constrained.py: what limits whitespace in a JSON schema's "
               "grammar? python -c 'import xgrammar; help(xgrammar.Grammar.from_json_schema)'"),
        checks=(B(8, "test_json_schema_answers_finish_and_parse"),),
        probe="json_whitespace_endless", guide="A grammar that never completes"),
    Bug("8.slow_to_shut_down", "server/detokenizer_worker.py",
        "    while child.parent_alive():\n        if recv.poll(POLL_TIMEOUT_MS):\n"
        "            to_api.send_pyobj(worker.handle(recv.recv_pyobj()))",
        "    while child.parent_alive():\n        try:  # a bad message must not end the worker\n"
        "            if recv.poll(POLL_TIMEOUT_MS):\n"
        "                to_api.send_pyobj(worker.handle(recv.recv_pyobj()))\n"
        "        except BaseException:\n            logger.exception(\"detokenizer worker\")",
        symptom="Ctrl-C takes five seconds to stop the server, and it warns that the detokenizer "
                "worker did not exit after SIGTERM and was killed; the others leave by themselves.",
        hints=("Run python -m common.diagnose server 8 --copy: which process is still alive "
               "after SIGTERM, and for how long?",
               "A child leaves on SIGTERM because its handler raises SystemExit in the main "
               "thread (ChildProcess in server/process.py). What could stop SystemExit from "
               "reaching the top of that process?",
               "Read the detokenizer worker's loop: which exceptions does it catch? SystemExit is "
               "a BaseException, not an Exception."),
        checks=(B(8, "test_the_detokenizer_worker_leaves_on_sigterm"),),
        probe="detokenizer_ignores_sigterm", guide="A server that hangs at shutdown"),
    # ------------------------------------------------------------ stage 9
    Bug("9.moe_answer_depends_on_batch", "moe.py",
        "topk_weights / topk_weights.sum(dim=-1, keepdim=True)",
        "topk_weights / topk_weights.sum()",
        symptom="A mixture-of-experts model's answer to a prompt changes with the other requests "
                "in its batch (and with chunked prefill); dense models are fine.",
        hints=("Run the prompt alone and with others: the MoE model differs, a dense one does "
               "not. Something in the MoE layer mixes tokens that should be independent.",
               "Feed the router the same token row alone and inside a batch: TopK's weights for "
               "it must be equal.",
               "Read TopK.forward: over what does renormalize sum, one token's k weights or more "
               "than that?"),
        checks=(E(9, "test_topk_picks_the_largest_and_renormalises_when_asked"),),
        probe="topk_mixes_tokens", guide=CHANGES),
    Bug("9.moe_gibberish", "moe.py",
        '"w1": [(0, 0)], "w3": [(Ip, 0)]', '"w1": [(Ip, 0)], "w3": [(0, 0)]',
        symptom="A mixture-of-experts checkpoint stored one tensor per expert loads without an "
                "error and answers nonsense; a checkpoint with stacked experts is fine.",
        hints=("Compare with transformers' logits at step 0 (the golden comparison): far off. "
               "Dense layers of the same model are right: look at the experts.",
               "Load one expert by hand and compare w13_weight with [gate; up] from the "
               "checkpoint.",
               "Read FusedMoE.weight_loader: where do w1 (gate) and w3 (up) go?"),
        checks=(E(9, "test_expert_loader_keeps_each_rank_slice"),),
        probe="expert_gate_up_swapped", guide=GIBBERISH),
]

BY_ID = {b.id: b for b in BUGS}
