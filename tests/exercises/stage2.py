"""Stage 2's exercises: the varlen (packed) metadata, the decode padding mask, varlen prefill,
batched sampling.

Run them with `python -m common.exercises check 2` (your copy) or `check 2 --reference`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

STAGE = "stage2_batch"


def requests(stage, lens, max_new_tokens=4):
    params = stage.core.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    reqs = [stage.core.Req(i, list(range(10 * i + 1, 10 * i + 1 + n)), params)
            for i, n in enumerate(lens)]
    for slot, req in zip([2, 0, 1], reqs):
        req.slot = slot
    return reqs


def prepare(stage, reqs, phase, pad_to_longest=False):
    # All that prepare reads of the engine: no model needed.
    host = SimpleNamespace(device=torch.device("cpu"), attn_backend="the backend")
    batch = stage.core.Batch(reqs, phase)
    return stage.engine.Engine.prepare(host, batch, "the cache", pad_to_longest)


@pytest.mark.task("2.varlen_metadata")
def test_prepare_packs_a_prefill_into_one_row(stage):
    reqs = requests(stage, [3, 2, 4])
    fb = prepare(stage, reqs, "prefill")
    assert fb.input_ids.tolist() == [1, 2, 3, 11, 12, 21, 22, 23, 24]
    assert fb.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert fb.cu_seqlens.tolist() == [0, 3, 5, 9] and fb.cu_seqlens.dtype == torch.int32
    assert fb.max_seqlen == 4 and fb.last_token_indices.tolist() == [2, 4, 8]
    assert fb.token_slot_ids.tolist() == [2, 2, 2, 0, 0, 1, 1, 1, 1]
    assert fb.slot_ids.tolist() == [2, 0, 1]
    assert fb.seq_lens.tolist() == [3, 2, 4] and fb.phase == "prefill"
    assert fb.kv_cache == "the cache" and fb.attn_backend == "the backend"


@pytest.mark.task("2.varlen_metadata")
def test_prepare_feeds_one_token_per_request_in_decode(stage):
    reqs = requests(stage, [3, 2, 4])
    for req, token in zip(reqs, [7, 8, 9]):
        req.complete_one(token)
    fb = prepare(stage, reqs, "decode")
    assert fb.input_ids.tolist() == [7, 8, 9] and fb.positions.tolist() == [3, 2, 4]
    assert fb.cu_seqlens.tolist() == [0, 1, 2, 3] and fb.last_token_indices.tolist() == [0, 1, 2]
    assert fb.seq_lens.tolist() == [4, 3, 5] and fb.max_seqlen == 1


@pytest.mark.task("2.varlen_metadata")
def test_prepare_pads_to_the_longest_when_asked(stage):
    fb = prepare(stage, requests(stage, [3, 2, 4]), "prefill", pad_to_longest=True)
    assert fb.input_ids.tolist() == [1, 2, 3, 0, 11, 12, 0, 0, 21, 22, 23, 24]  # pads go last
    assert fb.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    assert fb.cu_seqlens.tolist() == [0, 4, 8, 12] and fb.last_token_indices.tolist() == [2, 5, 11]
    assert fb.seq_lens.tolist() == [3, 2, 4], "seq_lens count real tokens only"


@pytest.mark.task("2.varlen_metadata")
def test_a_batch_gives_each_request_its_tokens_alone(stage, memo, tiny_llama_path):
    engine = memo("engine", lambda: stage.engine.Engine(tiny_llama_path, attention_backend="torch"))
    batch = requests(stage, [5, 1, 9], max_new_tokens=5)
    engine.generate(batch)
    for i, req in enumerate(batch):
        alone = stage.core.Req(0, list(req.input_ids), req.sampling_params)
        engine.generate([alone])
        assert alone.output_ids == req.output_ids, f"request {i} got other tokens in the batch"


def attend(q, k, v, causal):
    """One request: q [T, H, D], k, v [S, KVH, D] -> [T, H, D]; the causal mask aligns the ends."""
    H, KVH = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    T, S = q.shape[0], k.shape[0]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.task("2.padding_mask")
def test_decode_attends_to_each_request_own_keys_only(stage):
    torch.manual_seed(0)
    B, H, KVH, D, max_len = 3, 4, 2, 8, 10
    q = torch.randn(B, H, D)
    k_cache, v_cache = torch.randn(4, max_len, KVH, D), torch.randn(4, max_len, KVH, D)
    slot_ids = torch.tensor([3, 0, 2], dtype=torch.int32)
    seq_lens = torch.tensor([2, 7, 10], dtype=torch.int32)
    backend = stage.attention.torch_backend.TorchBackend()
    out = backend.decode(q, k_cache, v_cache, slot_ids, seq_lens, D**-0.5)
    for b in range(B):
        s, n = int(slot_ids[b]), int(seq_lens[b])
        want = attend(q[b : b + 1], k_cache[s, :n], v_cache[s, :n], causal=False)[0]
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.task("2.padding_mask")
def test_decode_ignores_what_lies_past_a_request_length(stage):
    torch.manual_seed(1)
    q, k_cache, v_cache = torch.randn(2, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    slot_ids = torch.tensor([0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([2, 6], dtype=torch.int32)
    backend = stage.attention.torch_backend.TorchBackend()
    first = backend.decode(q, k_cache, v_cache, slot_ids, seq_lens, 0.35)
    k_cache[0, 2:], v_cache[0, 2:] = 50.0, -50.0  # stale rows of the short request
    torch.testing.assert_close(backend.decode(q, k_cache, v_cache, slot_ids, seq_lens, 0.35), first)


@pytest.mark.task("2.varlen_prefill")
def test_prefill_is_causal_within_each_packed_request(stage):
    torch.manual_seed(2)
    lens = [3, 1, 5]
    N, H, KVH, D = sum(lens), 4, 2, 8
    q, k, v = torch.randn(N, H, D), torch.randn(N, KVH, D), torch.randn(N, KVH, D)
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    out = stage.attention.torch_backend.TorchBackend().prefill(q, k, v, cu, max(lens), D**-0.5)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = attend(q[a:b], k[a:b], v[a:b], causal=True)
        torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.task("2.varlen_prefill")
def test_prefill_requests_do_not_see_each_other(stage):
    torch.manual_seed(3)
    q, k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    backend = stage.attention.torch_backend.TorchBackend()
    first = backend.prefill(q, k, v, cu, 4, 0.35)
    k[:2], v[:2] = 30.0, -30.0  # only the first request's keys change
    second = backend.prefill(q, k, v, cu, 4, 0.35)
    torch.testing.assert_close(second[2:], first[2:])
    assert not torch.allclose(second[:2], first[:2])


def seeded(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.task("2.batched_sampling")
def test_greedy_rows_take_the_argmax(stage):
    SP, logits = stage.core.SamplingParams, torch.randn(4, 50)
    params = [SP(), SP(temperature=0.8, top_k=1), SP(), SP(temperature=0.0, top_p=0.5)]
    assert stage.sampler.sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


@pytest.mark.task("2.batched_sampling")
def test_sampling_follows_temperature_top_k_and_top_p(stage):
    SP, n = stage.core.SamplingParams, 3000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(n, 1)  # [n, 4]: n draws of one distribution, each its own seed
    gens = [seeded(i) for i in range(n)]

    def freqs(params):
        ids = torch.tensor(stage.sampler.sample(logits, [params] * n, gens))
        return torch.bincount(ids, minlength=4).float() / n

    torch.testing.assert_close(freqs(SP(temperature=1.0)), probs, atol=0.04, rtol=0)
    sharp = probs**2 / (probs**2).sum()  # temperature 0.5 squares the probabilities
    torch.testing.assert_close(freqs(SP(temperature=0.5)), sharp, atol=0.04, rtol=0)
    top2 = freqs(SP(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.8) < 0.04
    top_p = freqs(SP(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7: two tokens survive
    assert top_p[2:].sum() == 0 and 0 < top_p[1] < 1
    assert freqs(SP(temperature=1.0, top_p=0.3))[0] == 1.0, "the top token always survives"


@pytest.mark.task("2.batched_sampling")
def test_a_seeded_row_draws_the_same_token_in_any_batch(stage):
    SP = stage.core.SamplingParams
    torch.manual_seed(4)
    logits = torch.randn(3, 1000)
    params = SP(temperature=1.0, seed=7)
    alone = [stage.sampler.sample(logits[i : i + 1], [params], [seeded(7 + i)])[0]
             for i in range(3)]
    together = stage.sampler.sample(logits, [params, SP(), params], [seeded(7), None, seeded(9)])
    assert together[0] == alone[0] and together[2] == alone[2]
    assert together[1] == int(logits[1].argmax())
