"""Stage 9's MoE building blocks on the cases and invariants that SGLang's and vLLM's own unit tests check
(moe_align_block_size, fused MoE against a per-expert loop, top-k routing), with expert ids given as int32 (what
their top-k kernels return) and int64 (torch.topk) alike.

The shapes follow theirs, scaled down for a CPU: token counts that are 1, odd, a block or more; expert counts
that are and are not powers of two; every top-k from 1 to 6; block sizes 16 to 64. The Triton kernels run in the
interpreter (conftest sets TRITON_INTERPRET=1), on a handful of cases: they are slow there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stage9_moe.moe import FusedMoE, TopK, TopKOutput, fused_experts, moe_align_block_size, reference_experts

ID_DTYPES = [torch.int32, torch.int64]


def distinct_topk_ids(m: int, e: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[m, k]: k different experts per token, as a router's top-k gives."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(dtype)


def align_by_loop(topk_ids: torch.Tensor, block: int, e: int) -> tuple[list[int], list[int], int]:
    """The alignment spelled out: each expert's slots in slot order, padded with numel() to a whole block; one
    expert id per block. -> (sorted slots up to the padded length, expert of each block, padded length)."""
    flat = topk_ids.flatten().tolist()
    pad = len(flat)
    sorted_ids, expert_ids = [], []
    for expert in range(e):
        slots = [s for s, x in enumerate(flat) if x == expert]
        if not slots:
            continue
        padded = -(-len(slots) // block) * block
        sorted_ids += slots + [pad] * (padded - len(slots))
        expert_ids += [expert] * (padded // block)
    return sorted_ids, expert_ids, len(sorted_ids)


# ---------------------------------------------------------------- moe_align_block_size
@pytest.mark.parametrize("dtype", ID_DTYPES)
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("e", [8, 33])
@pytest.mark.parametrize("m", [1, 3, 16, 67])
def test_moe_align_block_size_matches_the_loop(m, e, k, block, dtype):
    ids = distinct_topk_ids(m, e, k, dtype, seed=m * 100 + e)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block, e)
    want_sorted, want_experts, want_len = align_by_loop(ids, block, e)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert num_post.tolist() == [want_len] and want_len % block == 0 and want_len >= m * k
    assert sorted_ids[:want_len].tolist() == want_sorted  # slot order kept within an expert
    assert expert_ids[: want_len // block].tolist() == want_experts
    # Past the padded length: padding only, and block experts that are valid ids (the kernel may read them).
    assert (sorted_ids[want_len:] == m * k).all()
    assert ((expert_ids >= 0) & (expert_ids < e)).all()
    # Sized without a host sync: at most the upstream bound numel + E * (block - 1), in whole blocks.
    assert sorted_ids.numel() == expert_ids.numel() * block
    assert want_len <= sorted_ids.numel() <= -(-(m * k + e * (block - 1)) // block) * block


@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_moe_align_block_size_with_repeated_and_skewed_experts(dtype):
    """Random ids may repeat within a token (SGLang's kernel test draws them so); all slots on one expert."""
    gen = torch.Generator().manual_seed(1)
    for ids in (torch.randint(0, 16, (37, 4), generator=gen), torch.full((29, 3), 5)):
        ids = ids.to(dtype)
        sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 16, 16)
        want_sorted, want_experts, want_len = align_by_loop(ids, 16, 16)
        assert num_post.item() == want_len and sorted_ids[:want_len].tolist() == want_sorted
        assert expert_ids[: want_len // 16].tolist() == want_experts


def test_moe_align_block_size_is_deterministic_and_dtype_blind():
    ids = torch.randint(0, 32, (128, 2), generator=torch.Generator().manual_seed(42))
    runs = [moe_align_block_size(ids.to(dtype), 64, 32) for dtype in ID_DTYPES for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


# ---------------------------------------------------------------- fused MoE against a per-slot loop
def moe_by_slots(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every token slot on its own: out[t] = sum_j w[t, j] * W2_e silu-and-mul(W13_e x_t), in float32."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(gate) * up))
    return out


def moe_inputs(m, e, k, h, i, dtype, id_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=gen) / 10).to(dtype)  # upstream's scale: inputs and weights / 10
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / 10).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / 10).to(dtype)
    routing = TopK(k, renormalize=False, weights_in_logits_dtype=False)(torch.randn(m, e, generator=gen))
    return x, w13, w2, routing.topk_weights, routing.topk_ids.to(id_dtype)


TORCH_CASES = [(1, 8, 2, 64, 48), (33, 8, 2, 96, 72), (64, 16, 6, 64, 48), (222, 8, 2, 64, 48),
               (7, 33, 4, 96, 48), (5, 4, 1, 64, 48)]  # (tokens, experts, top_k, hidden, intermediate)


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,e,k,h,i", TORCH_CASES)
def test_fused_moe_torch_path_matches_the_slot_loop(m, e, k, h, i, dtype, id_dtype):
    x, w13, w2, weights, ids = moe_inputs(m, e, k, h, i, dtype, id_dtype, seed=m)
    want = moe_by_slots(x, w13, w2, weights, ids)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got in (fused_experts(x, w13, w2, weights, ids, triton=False), reference_experts(x, w13, w2, weights, ids)):
        assert got.dtype == dtype and got.shape == (m, h)
        torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("m,e,k,h,i", [TORCH_CASES[0], TORCH_CASES[2], TORCH_CASES[4]])
def test_fused_moe_triton_path_matches_the_slot_loop(m, e, k, h, i, id_dtype):
    x, w13, w2, weights, ids = moe_inputs(m, e, k, h, i, torch.float32, id_dtype, seed=m)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, triton=True),
                               moe_by_slots(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("m", [1, 33, 222])
def test_fused_moe_on_cuda_takes_either_id_dtype(m, id_dtype):
    """The compiled kernels, bf16, at a wider shape (64 experts, top-6), against the slot loop in float32."""
    x, w13, w2, weights, ids = moe_inputs(m, 64, 6, 512, 352, torch.bfloat16, id_dtype, seed=m)
    got = fused_experts(x.cuda(), w13.cuda(), w2.cuda(), weights.cuda(), ids.cuda(), triton=True)
    torch.testing.assert_close(got.float().cpu(), moe_by_slots(x, w13, w2, weights, ids), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("runner", ["torch", "triton"])
def test_the_moe_layer_gives_the_same_output_for_int32_and_int64_ids(runner):
    e, k, h, i, m = 8, 2, 64, 48, 9
    layer = FusedMoE(e, k, h, i, runner_backend=runner)
    x, w13, w2, weights, ids = moe_inputs(m, e, k, h, i, torch.float32, torch.int64, seed=3)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    logits = torch.zeros(m, e)
    outs = [layer(x, TopKOutput(weights, ids.to(dtype), logits)) for dtype in ID_DTYPES]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0], moe_by_slots(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- top-k routing
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,e,k", [(1, 8, 2), (33, 16, 4), (64, 60, 4), (17, 128, 8)])
def test_topk_is_softmax_then_top_k(m, e, k, dtype, renormalize):
    logits = torch.randn(m, e, generator=torch.Generator().manual_seed(e)).to(dtype)
    out = TopK(k, renormalize, weights_in_logits_dtype=False)(logits)
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_ids = probs.topk(k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
        torch.testing.assert_close(out.topk_weights.sum(-1), torch.ones(m), atol=1e-6, rtol=0)
    # Ties are broken by the sort: compare the chosen set through the weights it picks out of probs.
    torch.testing.assert_close(probs.gather(1, out.topk_ids), probs.gather(1, want_ids))
    torch.testing.assert_close(out.topk_weights, want_w)
    assert out.topk_weights.dtype == torch.float32 and out.topk_ids.shape == (m, k)
    assert (out.topk_weights[:, :-1] >= out.topk_weights[:, 1:]).all(), "best first"
    assert all(len(set(row)) == k for row in out.topk_ids.tolist()), "k different experts per token"
    assert out.router_logits is logits


def test_topk_weights_in_the_logits_dtype_when_the_family_rounds_them():
    logits = torch.randn(5, 8).to(torch.bfloat16)
    assert TopK(2, True, weights_in_logits_dtype=True)(logits).topk_weights.dtype == torch.bfloat16
