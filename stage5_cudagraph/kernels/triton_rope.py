"""Rotary embedding (neox style, as layers.RotaryEmbedding) in Triton: q and k of one token per
program.

The torch version builds [N, D] cos and sin tables, a rotate_half copy of q and of k, and four
products: about ten kernels and several [N, H, D] temporaries per layer. Here one program loads its
token's position, computes the D/2 angles position * inv_freq in float32 (no table in memory), and
rotates every head of q and k in registers:

    out[:D/2] = x[:D/2] * cos - x[D/2:] * sin        out[D/2:] = x[D/2:] * cos + x[:D/2] * sin

cos and sin are rounded to the model dtype first, as the torch version does; the rest is float32,
rounded once.

Qwen3 normalises each head of q and k (RMSNorm over D) just before RoPE: with `norm=(q_weight,
k_weight, eps)` the same program does that too, on the head already in registers (the torch version:
two norms of ~8 kernels each, plus a copy of q and of k out of the merged qkv).
"""

from __future__ import annotations

import torch

from .triton_utils import INTERPRET, check_runnable, empty_out, round_to, tl, triton


@triton.jit
def _rotate_heads(X, Xo, W, n, stride_n, stride_h, stride_on, stride_oh, num_heads, cos, sin,
                  offs_d, mask_d, HALF, eps, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]  # [BLOCK_H, BLOCK_HALF]
    first = X + n * stride_n + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm of each head (row) over its D = 2 * HALF values, rounded as torch does
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(W + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        x1 = round_to(w1[None, :] * round_to(x1 * rstd[:, None], X.dtype.element_ty),
                      X.dtype.element_ty)
        x2 = round_to(w2[None, :] * round_to(x2 * rstd[:, None], X.dtype.element_ty),
                      X.dtype.element_ty)
    out = Xo + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(out + HALF, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)


@triton.jit
def _rope_kernel(
    # positions [N] int64; inv_freq [D/2] float32; q/out [N, H, D]; k/out [N, KVH, D]; the norms'
    # weights [D] (read only with HAS_NORM)
    Pos, InvFreq, Q, K, Qo, Ko, QW, KW,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_qon, stride_qoh, stride_kon, stride_koh,
    H, KVH, HALF, eps,
    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    # [BLOCK_HALF]
    angle = tl.load(Pos + n).to(tl.float32) * tl.load(InvFreq + offs_d, mask=mask_d, other=0.0)
    # rounded to the model dtype, as the torch version does
    cos = round_to(tl.cos(angle), Q.dtype.element_ty)
    sin = round_to(tl.sin(angle), Q.dtype.element_ty)
    _rotate_heads(Q, Qo, QW, n, stride_qn, stride_qh, stride_qon, stride_qoh, H, cos, sin, offs_d,
                  mask_d, HALF, eps, HAS_NORM, BLOCK_H)
    _rotate_heads(K, Ko, KW, n, stride_kn, stride_kh, stride_kon, stride_koh, KVH, cos, sin, offs_d,
                  mask_d, HALF, eps, HAS_NORM, BLOCK_KVH)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     inv_freq: torch.Tensor,
                     norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N]; q: [N, H, D]; k: [N, KVH, D] (any strides, last dim contiguous) -> new
    rotated q, k. norm=(q_weight [D], k_weight [D], eps): RMSNorm each head first (Qwen3)."""
    check_runnable(q, k)
    N, H, D = q.shape
    KVH = k.shape[1]
    if D % 2 or k.shape[0] != N or k.shape[2] != D or inv_freq.shape != (D // 2,):
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)}, k {tuple(k.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)} do not fit one even head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_weight, k_weight, eps = norm if norm is not None else (q, k, 0.0)  # unread without a norm
    if norm is not None and (q_weight.shape != (D,) or k_weight.shape != (D,)):
        raise ValueError(f"q/k norm weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} do "
                         f"not fit head_dim {D}")
    q_out, k_out = empty_out(q.shape, q.dtype, q.device), empty_out(k.shape, k.dtype, k.device)
    if N:
        _rope_kernel[(N, )](
            positions, inv_freq.float(), q, k, q_out, k_out, q_weight, k_weight, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), H, KVH, D // 2, eps, HAS_NORM=norm is not None,
            BLOCK_H=triton.next_power_of_2(H), BLOCK_KVH=triton.next_power_of_2(KVH),
            BLOCK_HALF=triton.next_power_of_2(D // 2), num_warps=4)
    if INTERPRET:
        q_out, k_out = q_out.to(q.dtype), k_out.to(k.dtype)
    return q_out, k_out
