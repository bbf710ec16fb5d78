"""Stage 9's exercises: top-k routing, moe_align_block_size, the experts' reference loop, the expert
weight loader.

Run them with `python -m common.exercises check 9` (your copy) or `check 9 --reference`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

STAGE = "stage9_moe"


def routing(M, E, k, seed=0, skew=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, E, generator=gen)
    if skew:
        logits[:, :k] += 10.0  # every token picks the same k experts: the others get nothing
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def experts(E, H, I, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=gen) * 0.3, torch.randn(E, H, I, generator=gen) * 0.3


def dense_moe(x, w13, w2, weights, ids):
    """Every expert on every token, then each token's k chosen outputs, weighted: the definition."""
    I = w2.shape[-1]
    gate, up = (x @ w13.transpose(1, 2)).split(I, dim=-1)  # [E, M, I] each
    everything = (F.silu(gate) * up) @ w2.transpose(1, 2)  # [E, M, H]
    picked = everything[ids, torch.arange(x.shape[0])[:, None]]  # [M, k, H]
    return (weights[..., None] * picked).sum(1)


@pytest.mark.task("9.topk_routing")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_topk_equals_transformers_routers(stage, family):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if family == "qwen3_moe":
        config = Qwen3MoeConfig(hidden_size=48, num_experts=16, num_experts_per_tok=4,
                                norm_topk_prob=True)
        hf = Qwen3MoeTopKRouter(config)
        ours = stage.moe.TopK(4, renormalize=True, weights_in_logits_dtype=True)
    else:
        config = MixtralConfig(hidden_size=48, num_local_experts=8, num_experts_per_tok=2)
        hf = MixtralTopKRouter(config)
        ours = stage.moe.TopK(2, renormalize=True, weights_in_logits_dtype=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
    hf = hf.bfloat16()
    x = torch.randn(37, 48, generator=gen).bfloat16()
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf(x)
    out = ours(F.linear(x, hf.weight))
    assert torch.equal(out.topk_ids, hf_ids) and out.topk_weights.dtype == hf_weights.dtype
    torch.testing.assert_close(out.topk_weights, hf_weights)


@pytest.mark.task("9.topk_routing")
def test_topk_picks_the_largest_and_renormalises_when_asked(stage):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 0.0, 4.0]])
    out = stage.moe.TopK(2, renormalize=False, weights_in_logits_dtype=False)(logits)
    assert out.topk_ids.tolist() == [[1, 3], [0, 3]], "best first"
    torch.testing.assert_close(out.topk_weights, torch.softmax(logits, -1).gather(1, out.topk_ids))
    normed = stage.moe.TopK(2, renormalize=True, weights_in_logits_dtype=False)(logits)
    torch.testing.assert_close(normed.topk_weights.sum(-1), torch.ones(2))
    assert normed.router_logits is logits


@pytest.mark.task("9.moe_align_block_size")
@pytest.mark.parametrize("M, E, k, block, skew",
                         [(5, 8, 2, 4, False), (9, 4, 2, 16, False), (12, 16, 4, 4, True)])
def test_align_sorts_slots_by_expert_into_padded_blocks(stage, M, E, k, block, skew):
    _, ids = routing(M, E, k, seed=M, skew=skew)
    sorted_ids, expert_ids, num_post = stage.moe.moe_align_block_size(ids, block, E)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    flat, S = ids.flatten(), M * k
    counts = torch.bincount(flat, minlength=E)
    n = int(num_post)
    assert n == sum(-(-int(c) // block) * block for c in counts), "each run padded to the block"
    assert sorted_ids.numel() == expert_ids.numel() * block >= n and (sorted_ids[n:] == S).all()
    real = sorted_ids[:n].view(-1, block)
    assert sorted(real[real < S].tolist()) == list(range(S)), "every slot exactly once"
    for b, row in enumerate(real):  # a block holds one expert's slots, in slot order, then padding
        mine = row[row < S]
        assert len(mine) > 0 and (flat[mine.long()] == expert_ids[b]).all()
        assert mine.tolist() == sorted(mine.tolist()) and (row[len(mine) :] == S).all()


@pytest.mark.task("9.moe_align_block_size")
def test_align_output_sizes_depend_on_shapes_only(stage):
    """No host sync: the output lengths follow from M, k, E and the block, whatever the routing."""
    sizes = set()
    for skew in (False, True):
        outputs = stage.moe.moe_align_block_size(routing(10, 8, 2, skew=skew)[1], 4, 8)
        sizes.add(tuple(t.numel() for t in outputs))
    assert len(sizes) == 1


@pytest.mark.task("9.moe_align_block_size")
def test_the_fused_path_on_aligned_blocks_equals_the_definition(stage):
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
    w13, w2 = experts(8, 16, 12)
    weights, ids = routing(7, 8, 2, seed=3)
    got = stage.moe.fused_experts(x, w13, w2, weights, ids, triton=False, config={"BLOCK_M": 4})
    torch.testing.assert_close(got, dense_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.task("9.reference_experts")
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "few-experts"])
def test_reference_experts_equal_the_definition(stage, skew):
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    w13, w2 = experts(6, 16, 10)
    weights, ids = routing(9, 6, 2, seed=5, skew=skew)
    got = stage.moe.reference_experts(x, w13, w2, weights, ids)
    assert got.shape == x.shape
    torch.testing.assert_close(got, dense_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def load_moe(stage, rank, tp, w1, w3, w2, stacked=False):
    E, I, H = w1.shape
    moe = stage.moe.FusedMoE(E, 2, H, I, tp_rank=rank, tp_size=tp)
    if stacked:  # a checkpoint with all experts in one tensor (gate rows, then up)
        moe.w13_weight.weight_loader(moe.w13_weight, torch.cat([w1, w3], dim=1), (None, "w13"))
        moe.w2_weight.weight_loader(moe.w2_weight, w2, (None, "w2"))
    else:
        for e in range(E):
            moe.w13_weight.weight_loader(moe.w13_weight, w3[e], (e, "w3"))
            moe.w13_weight.weight_loader(moe.w13_weight, w1[e], (e, "w1"))
            moe.w2_weight.weight_loader(moe.w2_weight, w2[e], (e, "w2"))
    return moe


@pytest.mark.task("9.expert_weight_loader")
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_expert_loader_keeps_each_rank_slice(stage, stacked):
    gen = torch.Generator().manual_seed(6)
    E, H, I = 3, 8, 6
    w1, w3 = torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen)
    w2 = torch.randn(E, H, I, generator=gen)
    for rank in range(2):
        moe = load_moe(stage, rank, 2, w1, w3, w2, stacked)
        rows = slice(3 * rank, 3 * rank + 3)
        want = torch.cat([w1[:, rows], w3[:, rows]], dim=1)
        assert torch.equal(moe.w13_weight, want), "[its gate slice | its up slice]"
        assert torch.equal(moe.w2_weight, w2[:, :, rows])


@pytest.mark.task("9.expert_weight_loader")
def test_expert_ranks_partial_sums_add_up_and_bad_shapes_are_refused(stage):
    gen = torch.Generator().manual_seed(7)
    E, H, I = 4, 8, 6
    w1, w3 = torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen)
    w2 = torch.randn(E, H, I, generator=gen)
    x, (weights, ids) = torch.randn(5, H, generator=gen), routing(5, E, 2, seed=8)
    whole = load_moe(stage, 0, 1, w1, w3, w2)
    want = dense_moe(x, torch.cat([w1, w3], 1), w2, weights, ids)
    torch.testing.assert_close(dense_moe(x, whole.w13_weight, whole.w2_weight, weights, ids), want)
    halves = [load_moe(stage, r, 2, w1, w3, w2) for r in range(2)]
    parts = [dense_moe(x, m.w13_weight, m.w2_weight, weights, ids) for m in halves]  # I/2 each
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-4, rtol=1e-4)  # the all-reduce
    with pytest.raises(ValueError, match="shape"):
        whole.w2_weight.weight_loader(whole.w2_weight, w2[0].T, (0, "w2"))


@pytest.mark.task("9.accept_draft")
def test_accept_draft_keeps_the_longest_prefix_and_adds_the_targets_token(stage):
    accept = stage.speculative.verify.accept_draft
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7], "every draft right: all kept, plus target[k]"
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9], "stop at the first mismatch: the target's token there"
    assert accept([4, 5, 6], [8, 5, 6, 7]) == [8], "first draft wrong: the target's own token alone"
    assert accept([], [3]) == [3], "no draft: a plain decode step"
    assert accept([1, 1], [1, 2, 1]) == [1, 2]


@pytest.mark.task("9.dequantize_q4_1")
def test_dequantize_q4_1_unpacks_nibbles_scale_and_min(stage):
    import numpy as np

    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # d
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)  # m
    block[4:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    got = stage.quantization.dequantize_q4_1(torch.from_numpy(block).reshape(1, 20))
    low, high = torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)
    expected = torch.cat([low, high]) * 0.5 - 1.0  # weights 0-15 from low nibbles, 16-31 high
    assert got.dtype == torch.float32 and got.shape == (1, 32)
    assert torch.equal(got[0], expected), "weight j: low nibble of byte j; weight j + 16: high"


@pytest.mark.task("9.dequantize_q4_1")
def test_dequantize_q4_1_equals_llama_cpps_dequantizer(stage):
    import gguf
    import numpy as np

    w = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)  # [5, 3 * 20]
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_1)
    got = stage.quantization.dequantize_q4_1(torch.from_numpy(data))
    assert torch.equal(got, torch.from_numpy(expected)), "rows of several blocks, bit for bit"
