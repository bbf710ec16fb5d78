"""Stage 9 kernels: every Triton kernel equals its torch version (kernels/native.py) on odd shapes.

On a CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the same tests run on a GPU
(`cuda` marker) with larger shapes. Token counts from 1 to a few hundred, widths that are not powers of two, and
for the MoE GEMMs: every expert empty or full, top-k 1 to 8, E in {4, 8, 16}.
"""

from __future__ import annotations

import pytest
import torch

from stage9_moe import kernels
from stage9_moe.kernels import native
from stage9_moe.moe import TopK, fused_experts, moe_align_block_size, reference_experts

triton_norm = pytest.importorskip("stage9_moe.kernels.triton_norm")
from stage9_moe.kernels import triton_activation, triton_moe, triton_rope  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def rand(*shape, dtype=torch.float32, device="cpu", scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: summation order only. bf16: one rounding of the fused kernel vs two of torch, at most 1-2 ulps.
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# ------------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 96), (300, 200)])
def test_rmsnorm_matches_torch(device, dtype, rows, dim):
    x, w = rand(rows, dim, dtype=dtype, device=device, scale=3), rand(dim, dtype=dtype, device=device, seed=1)
    got = triton_norm.rmsnorm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, native.rmsnorm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (13, 200)])
def test_fused_add_rmsnorm_matches_torch(device, dtype, rows, dim):
    x, r = rand(rows, dim, dtype=dtype, device=device), rand(rows, dim, dtype=dtype, device=device, seed=2)
    w = rand(dim, dtype=dtype, device=device, seed=1)
    got, got_res = triton_norm.fused_add_rmsnorm(x, r, w, 1e-6)
    want, want_res = native.fused_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(got_res, want_res)  # one add of two same-dtype numbers: the same bits everywhere
    close(got, want, dtype)
    if dtype == torch.bfloat16:  # the norm reads the rounded sum: normalising the exact sum would differ
        exact = native.rmsnorm((x.float() + r.float()), w.float(), 1e-6).to(dtype)
        assert not torch.equal(want, exact) and torch.equal(got, want)


def test_rmsnorm_of_a_strided_view():
    """q from the merged qkv is a non-contiguous [N, H, D] view: the per-head norm must read it right."""
    qkv = rand(5, 3 * 4 * 32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    w = rand(32, seed=3)
    close(triton_norm.rmsnorm(q, w, 1e-6), native.rmsnorm(q, w, 1e-6), torch.float32)


# ------------------------------------------------------------------------------------------ SiLU-and-mul
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(1, 48), (33, 100), (3, 1500)])  # 1500 > one block: two programs per row
def test_silu_and_mul_matches_torch(device, dtype, rows, d):
    x = rand(rows, 2 * d, dtype=dtype, device=device, scale=2)
    close(triton_activation.silu_and_mul(x), native.silu_and_mul(x), dtype)


# ------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 4, 2, 32), (13, 8, 1, 48), (40, 3, 3, 128)])
def test_rope_matches_torch(device, dtype, n, heads, kv_heads, head_dim):
    qkv = rand(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)  # strided views
    q, k = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(n)).to(device)
    inv_freq = (1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))).to(device)
    got_q, got_k = triton_rope.rotary_embedding(positions, q, k, inv_freq)
    want_q, want_k = native.rotary_embedding(positions, q, k, inv_freq)
    # float32 angles up to 4000 rad: cos/sin of two libraries differ by a few ulps of the angle
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1.6e-2)
    torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
    torch.testing.assert_close(got_k.float(), want_k.float(), **tol)


# ------------------------------------------------------------------------------------------ MoE
def routing(kind: str, M: int, E: int, top_k: int, device="cpu", seed=0):
    """topk_ids / weights of M tokens: "random"; "one" (every token's first choice is expert 0, the others empty
    but for the choices 2..k); "full" (each expert gets exactly 16 slots: full blocks, no padding)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        logits = torch.randn(M, E, generator=gen)
    elif kind == "one":
        logits = torch.randn(M, E, generator=gen)
        logits[:, 0] += 100.0
        if top_k == 1:
            logits[:, 1:] -= 100.0
    else:  # "full": token t's choices are experts t, t + E/k, t + 2E/k, ... (mod E): each expert gets M*k/E slots
        assert M * top_k == 16 * E and M % E == 0
        ids = (torch.arange(M)[:, None] + torch.arange(top_k)[None, :] * (E // top_k)) % E  # [M, k], distinct
        logits = torch.full((M, E), -10.0)
        logits.scatter_(1, ids, torch.linspace(5, 1, top_k).expand(M, top_k).contiguous())
    out = TopK(top_k, renormalize=True, weights_in_logits_dtype=False)(logits.to(device))
    return out.topk_weights, out.topk_ids


def moe_weights(E, H, I, dtype=torch.float32, device="cpu"):
    return (rand(E, 2 * I, H, dtype=dtype, device=device, scale=H ** -0.5, seed=5),
            rand(E, H, I, dtype=dtype, device=device, scale=I ** -0.5, seed=6))


MOE_CASES = [  # (tokens, experts, top_k, hidden, intermediate, routing)
    (1, 4, 1, 96, 48, "random"),
    (1, 16, 8, 200, 72, "random"),
    (5, 8, 2, 200, 72, "random"),
    (64, 16, 8, 96, 48, "random"),
    (257, 8, 2, 200, 72, "random"),
    (37, 8, 1, 96, 48, "one"),  # all tokens to expert 0, the other 7 experts empty
    (30, 4, 3, 96, 48, "one"),
    (32, 4, 2, 96, 48, "full"),  # every expert exactly 16 slots: full blocks of 16, no padding
    (64, 16, 4, 200, 72, "full"),
]


@pytest.mark.parametrize("M,E,top_k,H,I,kind", MOE_CASES)
def test_moe_align_block_size(M, E, top_k, H, I, kind):
    _, ids = routing(kind, M, E, top_k)
    for block in (16, 64):
        sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block, E)
        flat, S = ids.flatten(), M * top_k
        counts = torch.bincount(flat, minlength=E)
        assert num_post.item() == sum(-(-int(c) // block) * block for c in counts)
        assert sorted_ids.numel() == expert_ids.numel() * block >= num_post.item()
        real = sorted_ids[: num_post.item()].view(-1, block)
        assert sorted(real[real < S].tolist()) == list(range(S))  # every slot exactly once
        assert (sorted_ids[num_post.item():] == S).all()  # past the end: padding only
        for b, row in enumerate(real):  # each block: one expert's slots, in slot order, then padding
            slots = row[row < S]
            assert (flat[slots.long()] == expert_ids[b]).all()
            assert slots.tolist() == sorted(slots.tolist()) and (row[len(slots):] == S).all()
        blocks_per_expert = torch.bincount(expert_ids[: num_post.item() // block].long(), minlength=E)
        assert blocks_per_expert.tolist() == [-(-int(c) // block) for c in counts]  # an empty expert: no block


@pytest.mark.parametrize("M,E,top_k,H,I,kind", MOE_CASES)
def test_fused_moe_triton_matches_reference(M, E, top_k, H, I, kind):
    x = rand(M, H, seed=M)
    w13, w2 = moe_weights(E, H, I)
    weights, ids = routing(kind, M, E, top_k)
    want = reference_experts(x, w13, w2, weights, ids)
    got = fused_experts(x, w13, w2, weights, ids, triton=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("M,E,top_k,H,I,kind", MOE_CASES[::2])
def test_fused_moe_torch_blocks_match_reference(M, E, top_k, H, I, kind):
    x = rand(M, H, seed=M)
    w13, w2 = moe_weights(E, H, I)
    weights, ids = routing(kind, M, E, top_k)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, triton=False),
                               reference_experts(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_moe_gemms_match_their_torch_versions(device, block_m):
    """Each GEMM kernel alone (gate_up with SiLU-and-mul fused; down with the routing weight), bf16 too."""
    M, E, top_k, H, I = 29, 8, 2, 200, 72
    for dtype in (torch.float32, torch.bfloat16):
        x = rand(M, H, dtype=dtype, device=device)
        w13, w2 = moe_weights(E, H, I, dtype, device)
        weights, ids = routing("random", M, E, top_k, device)
        config = dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)
        sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block_m, E)
        inter = triton_moe.fused_moe_gate_up(x, w13, sorted_ids, expert_ids, num_post, top_k, config)
        close(inter, native.fused_moe_gate_up(x, w13, sorted_ids, expert_ids, top_k), dtype)
        down = triton_moe.fused_moe_down(inter, w2, weights, sorted_ids, expert_ids, num_post, config)
        close(down, native.fused_moe_down(inter, w2, weights, sorted_ids, expert_ids), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 7, 64, 512, 2048])
def test_fused_moe_cuda_bf16_matches_reference(M):
    E, top_k, H, I = 64, 8, 1024, 352
    x = rand(M, H, dtype=torch.bfloat16, device="cuda")
    w13, w2 = moe_weights(E, H, I, torch.bfloat16, "cuda")
    weights, ids = routing("random", M, E, top_k, "cuda")
    want = reference_experts(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_experts(x, w13, w2, weights, ids, triton=True)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------------------------------------ dispatch
def test_cpu_default_is_torch_and_triton_can_be_forced():
    x = torch.randn(3, 8)
    assert kernels.current_backend() == "auto" and not kernels.use_triton(x)
    with kernels.use_backend("triton"):
        assert kernels.use_triton(x)
        close(kernels.rmsnorm(x, torch.ones(8), 1e-6), native.rmsnorm(x, torch.ones(8), 1e-6), torch.float32)
    with kernels.use_backend("torch"):
        assert not kernels.use_triton(x)
    assert kernels.current_backend() == "auto"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with kernels.use_backend("cuda"):
            pass


def test_kernels_refuse_bad_shapes():
    with pytest.raises(ValueError, match="weight shape"):
        triton_norm.rmsnorm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="even last dim"):
        triton_activation.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="BLOCK_M"):
        ids = torch.zeros(4, 2, dtype=torch.long)
        s, e, n = moe_align_block_size(ids, 16, 4)
        triton_moe.fused_moe_gate_up(torch.randn(4, 8), torch.randn(4, 6, 8), s, e, n, 2,
                                     dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1))
