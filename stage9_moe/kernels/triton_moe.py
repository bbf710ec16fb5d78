"""The fused MoE GEMMs in Triton: every expert of a layer in one launch per projection.

Input: the token slots sorted by expert and padded (moe.moe_align_block_size). A slot is one (token,
choice) pair, s = token * top_k + j; sorted_token_ids lists the slots expert by expert, each
expert's run padded with the invalid id M * top_k up to a multiple of BLOCK_M, so that every block
of BLOCK_M entries belongs to ONE expert, named by expert_ids[block]:

    sorted_token_ids   [ 3  0  5  P | 1  4  P  P | 2  P  P  P ]      (BLOCK_M = 4, P = padding)
    expert_ids         [     0      |     2      |     3      ]      (expert 1 got no token: no
                                                                     block at all)

The grid is (blocks, BLOCK_N tiles of the output width). Program (m, n) loads its block's slot ids,
gathers those tokens' rows of A, and multiplies them by the [BLOCK_N, K] tile of its block's expert:
a normal tiled GEMM whose A rows are gathered and whose B is picked per block. Padding rows are
masked (loaded as 0, never stored). Axis 0 runs fastest, so programs launched together are
consecutive blocks of the same expert and the same n: they read the same weight tile, which stays in
L2. That is the point: in decode each expert sees a handful of tokens, the GEMM is as thin as a
matrix-vector product, and the cost is reading the expert's weights once.

- gate_up kernel: A = hidden states [M, K] (slot s reads token s // top_k), B = w13 [E, 2*I, K].
  Each program keeps two accumulators, gate (rows n of w13) and up (rows I + n), and writes
  silu(gate) * up: the [slots, 2*I] gate/up tensor never exists in memory (SiLU-and-mul fused into
  the GEMM's epilogue).
- down kernel: A = that [slots, I] output (slot s reads row s), B = w2 [E, H, I]; the routing weight
  of each slot multiplies the float32 accumulator before the store. The caller sums the top_k slots
  of each token.

The grid is sized from an upper bound on the padded length, not from the real one (which is on the
device): blocks past num_tokens_post_padded return at once. No host sync, so a CUDA graph can
capture the whole layer.
"""

from __future__ import annotations

import torch

from .triton_utils import INTERPRET, check_runnable, dot_flags, empty_out, tl, triton


@triton.jit
def _fused_moe_kernel(
    # A [rows, K]; B [E, N_total, K]; C [slots, N]; TopkWeights [slots] (down kernel)
    A, B, C, TopkWeights,
    SortedTokenIds, ExpertIds, NumTokensPostPadded,  # [EM] int32, [EM / BLOCK_M] int32, [1] int32
    N, K, num_slots,  # output width, reduction length, M * top_k (the padding id)
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,  # slot s reads row s // A_ROW_DIV of A: top_k for gate_up, 1 for down
    GATE_UP: tl.constexpr,  # two accumulators (rows n and N + n of B) and silu(gate) * up, else one
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumTokensPostPadded):
        return  # a block past the real padded length (the grid was sized for the worst case)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(SortedTokenIds + offs_m).to(tl.int64)  # [BLOCK_M]
    slot_mask = slots < num_slots  # padding entries hold num_slots
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)  # one expert for the whole block
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    # [BLOCK_M, BLOCK_K]
    a_ptrs = A + (slots // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    # B tile as [BLOCK_K, BLOCK_N]: the expert's rows offs_n, read along K (contiguous in memory).
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if GATE_UP:  # the up projection: rows N + offs_n of the same expert, same A tile
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :],
                           other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in float32, before the one rounding
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(TopkWeights + slots, mask=slot_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = C + slots[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=slot_mask[:, None] & n_mask[None, :])


def moe_config(num_slots: int, num_experts: int) -> dict:
    """Tile sizes (the defaults SGLang uses without a tuned config file: thin tiles when there are
    about as few slots as experts, as in decode; bigger ones for prefill). Not tuned here: retune on
    a GPU."""
    if INTERPRET:  # each program is a Python loop: fewer, bigger tiles are faster
        return dict(BLOCK_M=16 if num_slots <= 4 * num_experts else 32, BLOCK_N=64, BLOCK_K=64,
                    num_warps=4, num_stages=1)
    if num_slots <= num_experts:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)


def _launch(a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, N, K,
            num_slots, a_row_div: int, gate_up: bool, config: dict) -> None:
    block_m = config["BLOCK_M"]
    if sorted_token_ids.numel() != expert_ids.numel() * block_m:
        raise ValueError(
            f"sorted_token_ids ({sorted_token_ids.numel()}) is not {expert_ids.numel()} blocks of "
            f"BLOCK_M={block_m}: align the tokens with the same config")
    if expert_ids.numel() == 0 or N == 0:
        return
    upcast, precision = dot_flags(a.dtype)
    grid = (expert_ids.numel(), triton.cdiv(N, config["BLOCK_N"]))
    _fused_moe_kernel[grid](
        # gate_up: any pointer, MUL_ROUTED_WEIGHT is off
        a, b, c, c if topk_weights is None else topk_weights,
        sorted_token_ids, expert_ids, num_tokens_post_padded, N, K, num_slots,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATE_UP=gate_up, MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], UPCAST=upcast,
        DOT_PRECISION=precision, num_warps=config["num_warps"], num_stages=config["num_stages"])


def fused_moe_gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_token_ids: torch.Tensor,
                      expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor, top_k: int,
                      config: dict) -> torch.Tensor:
    """x: [M, H]; w13: [E, 2*I, H] -> silu(gate) * up per slot, [M * top_k, I]."""
    check_runnable(x, w13)
    M, H = x.shape
    I = w13.shape[1] // 2
    out = empty_out((M * top_k, I), x.dtype, x.device)
    _launch(x, w13, out, None, sorted_token_ids, expert_ids, num_tokens_post_padded, I, H,
            M * top_k, a_row_div=top_k, gate_up=True, config=config)
    return out.to(x.dtype) if INTERPRET else out


def fused_moe_down(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                   num_tokens_post_padded: torch.Tensor, config: dict) -> torch.Tensor:
    """inter: [M * top_k, I]; w2: [E, H, I] -> routing weight * (inter W2^T) per slot, [M * top_k,
    H]."""
    check_runnable(inter, w2)
    num_slots, I = inter.shape
    H = w2.shape[1]
    if inter.stride(-1) != 1:
        inter = inter.contiguous()
    out = empty_out((num_slots, H), inter.dtype, inter.device)
    _launch(inter, w2, out, topk_weights.reshape(-1), sorted_token_ids, expert_ids,
            num_tokens_post_padded, H, I, num_slots, a_row_div=1, gate_up=False, config=config)
    return out.to(inter.dtype) if INTERPRET else out
