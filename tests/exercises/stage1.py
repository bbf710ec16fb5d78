"""Stage 1's exercises: a request's bookkeeping, causal attention, the KV cache append, the decode
loop.

Run them with `python -m common.exercises check 1` (your copy) or `check 1 --reference`.
"""

from __future__ import annotations

import pytest
import torch

STAGE = "stage1_naive"


def naive_attention(q, k, v):
    """The definition, one query and one head at a time: query t of T sits at position S - T + t."""
    T, H, D = q.shape
    S, KVH, _ = k.shape
    out = torch.empty_like(q)
    for t in range(T):
        visible = S - T + t + 1
        for h in range(H):
            kv = h // (H // KVH)
            scores = k[:visible, kv] @ q[t, h] / D**0.5  # [visible]
            out[t, h] = torch.softmax(scores, dim=0) @ v[:visible, kv]
    return out


@pytest.mark.task("1.complete_one")
def test_complete_one_moves_the_request_forward(stage):
    req = stage.core.Req(0, [10, 11, 12, 13, 14], stage.core.SamplingParams(max_new_tokens=3))
    req.complete_one(99)  # after the prefill
    assert (req.cached_len, req.device_len, req.extend_len) == (5, 6, 1)
    assert req.output_ids == [99] and req.next_input_ids() == [99]
    req.complete_one(98)  # after one decode step
    assert (req.cached_len, req.device_len, req.output_ids) == (6, 7, [99, 98])
    assert req.next_input_ids() == [98] and req.all_ids == [10, 11, 12, 13, 14, 99, 98]
    req.check_invariants()


def engine(stage, memo, path):
    return memo("static", lambda: stage.engine.Engine(path))


def new_cache(stage, max_len=6):
    return stage.kv_cache.StaticKVCache(num_layers=2, max_len=max_len, num_kv_heads=2, head_dim=4,
                                        dtype=torch.float32, device="cpu")


@pytest.mark.task("1.kv_cache_append")
def test_static_cache_appends_in_place_and_returns_views(stage):
    cache = new_cache(stage)
    prompt_k, prompt_v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)  # a 3-token prefill
    for layer in range(2):
        k_all, v_all = cache.update(layer, prompt_k + layer, prompt_v - layer)
        assert k_all.shape == v_all.shape == (3, 2, 4)
        assert torch.equal(k_all, prompt_k + layer) and torch.equal(v_all, prompt_v - layer)
        assert k_all.data_ptr() == cache.k[layer].data_ptr(), "a view of the cache, not a copy"
        assert cache.seq_len == (0 if layer == 0 else 3), "seq_len moves once the last layer wrote"
    new_k, new_v = torch.randn(1, 2, 4), torch.randn(1, 2, 4)  # one decode step
    for layer in range(2):
        k_all, v_all = cache.update(layer, new_k, new_v)
        assert k_all.shape == (4, 2, 4)
        assert torch.equal(k_all[:3], prompt_k + layer), "earlier rows are kept"
        assert torch.equal(k_all[3], new_k[0]) and torch.equal(v_all[3], new_v[0])
    assert cache.seq_len == 4


@pytest.mark.task("1.kv_cache_append")
def test_static_cache_refuses_more_rows_than_it_has(stage):
    cache = new_cache(stage, max_len=4)
    for layer in range(2):
        cache.update(layer, torch.zeros(3, 2, 4), torch.zeros(3, 2, 4))
    with pytest.raises(RuntimeError, match="full"):
        cache.update(0, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))


@pytest.mark.task("1.kv_cache_append")
def test_the_model_reads_the_static_cache_as_the_growing_one(stage, memo, tiny_llama_path):
    e = engine(stage, memo, tiny_llama_path)
    model, cfg = e.model, e.config
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    static = stage.kv_cache.StaticKVCache(cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim,
                                          torch.float32, "cpu")
    caches = [static, stage.kv_cache.GrowingKVCache(cfg.num_layers)]
    logits = []
    for cache in caches:  # a 5-token prefill, then two decode steps
        steps = [(0, 5), (5, 6), (6, 7)]
        logits.append([model(ids[a:b], torch.arange(a, b), cache) for a, b in steps])
    for static, growing in zip(*logits):
        torch.testing.assert_close(static, growing)
    assert caches[0].seq_len == 7


@pytest.mark.task("1.causal_attention")
@pytest.mark.parametrize("T, S", [(5, 5), (1, 9), (3, 8)], ids=["prefill", "decode", "extend"])
def test_causal_attention_matches_the_definition(stage, T, S):
    torch.manual_seed(T * 10 + S)
    q = torch.randn(T, 4, 8)  # GQA: 4 query heads, 2 K/V heads
    k, v = torch.randn(S, 2, 8), torch.randn(S, 2, 8)
    out = stage.layers.causal_attention(q, k, v)
    assert out.shape == (T, 4, 8)
    torch.testing.assert_close(out, naive_attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.task("1.causal_attention")
def test_causal_attention_never_reads_a_later_key(stage):
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    first = stage.layers.causal_attention(q, k, v)
    k[2:], v[2:] = 100.0, -100.0  # change only the keys of positions 2 and 3
    second = stage.layers.causal_attention(q, k, v)
    torch.testing.assert_close(first[:2], second[:2])  # queries 0 and 1 cannot see them
    assert not torch.allclose(first[2:], second[2:])


@pytest.mark.task("1.decode_loop")
def test_generate_equals_recomputing_without_a_cache(stage, memo, tiny_llama_path):
    """Greedy: each generated token is the argmax of a full forward pass over all before it."""
    e = engine(stage, memo, tiny_llama_path)
    req = e.generate(stage.core.Req(0, [3, 1, 4, 1, 5, 9, 2, 6],
                                    stage.core.SamplingParams(max_new_tokens=8, ignore_eos=True)))
    assert len(req.output_ids) == 8 and req.finished and req.finish_reason == "length"
    ids = torch.tensor(req.all_ids[:-1])
    cache = stage.kv_cache.GrowingKVCache(e.config.num_layers)
    full = e.model(ids, torch.arange(len(ids)), cache, last_only=False)  # [len, vocab]
    assert full.argmax(-1)[len(req.input_ids) - 1 :].tolist() == req.output_ids


@pytest.mark.task("1.decode_loop")
def test_generate_stops_at_a_stop_token(stage, memo, tiny_llama_path):
    e, SP, Req = engine(stage, memo, tiny_llama_path), stage.core.SamplingParams, stage.core.Req
    free = e.generate(Req(0, [7, 8, 9], SP(max_new_tokens=12, ignore_eos=True))).output_ids
    stop_at = free[4]
    stopped = e.generate(Req(1, [7, 8, 9], SP(max_new_tokens=12, stop_token_ids=[stop_at])))
    assert stopped.output_ids == free[: free.index(stop_at) + 1] and stopped.finish_reason == "stop"


@pytest.mark.task("1.decode_loop")
def test_generate_samples_with_the_request_seed(stage, memo, tiny_llama_path):
    e, SP, Req = engine(stage, memo, tiny_llama_path), stage.core.SamplingParams, stage.core.Req
    runs = []
    for i, seed in enumerate([5, 5, 6]):
        params = SP(max_new_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        runs.append(e.generate(Req(i, [1, 2, 3], params)).output_ids)
    assert runs[0] == runs[1], "the same seed draws the same tokens"
    assert runs[0] != runs[2], "another seed draws others (random weights: nearly uniform)"
