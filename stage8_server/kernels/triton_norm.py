"""RMSNorm in Triton, with the residual add fused in (SGLang's fused_add_rmsnorm).

In every decoder layer the residual stream is added to and then normalised, twice:

    residual = residual + attn_out;  h = rmsnorm(residual)      (and again around the MLP)

Unfused that is two kernels and three trips through memory for a [N, hidden] tensor (the add reads
two and writes one, the norm reads it back). The fused kernel reads x and the residual once, writes
the new residual and the normalised row: one launch, and the sum never makes the round trip. One
program normalises one row: the row fits in one tile (BLOCK_D = next power of two >= hidden), so the
mean of squares is a single tl.sum.

Numerics follow transformers: the sum is rounded to the model dtype before it is normalised (the
residual stream *is* stored in that dtype), the norm is computed in float32, rounded, then
multiplied by the weight.
"""

from __future__ import annotations

import torch

from .triton_utils import (
    INTERPRET,
    check_runnable,
    empty_out,
    num_warps_for,
    round_to,
    row_block,
    tl,
    triton,
)

@triton.jit
def _rmsnorm_kernel(
    X, R, W, Y, R_out,  # x, residual: [rows, D] inputs; y, residual_out: [rows, D] outputs; w: [D]
    stride_x, stride_r, stride_y, stride_ro,  # row strides (the last dim is contiguous)
    D, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 for a big prefill
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, X.dtype.element_ty)  # the residual stream holds the rounded sum
        tl.store(R_out + row * stride_ro + offs, x, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)  # masked lanes are 0: they add nothing
    y = round_to(x * rstd, X.dtype.element_ty)  # rounded before the weight, as transformers does
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, w * y, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # a view when it can be (q from the merged qkv is not: then a copy)
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    check_runnable(x, weight)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match rows of width {D}")
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    y = empty_out(x2.shape, x.dtype, x.device)
    r_out = empty_out(x2.shape, x.dtype, x.device) if residual is not None else y
    if x2.shape[0]:
        BLOCK_D = row_block(D)
        _rmsnorm_kernel[(x2.shape[0], )](x2, r2, weight, y, r_out, x2.stride(0), r2.stride(0),
                                         y.stride(0), r_out.stride(0), D, eps, HAS_RESIDUAL=residual
                                         is not None, BLOCK_D=BLOCK_D,
                                         num_warps=num_warps_for(BLOCK_D))
    if INTERPRET:  # float32 buffers: torch rounds (the interpreter's own bf16 store would truncate)
        y, r_out = y.to(x.dtype), r_out.to(x.dtype)
    return y.view(x.shape), r_out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> rmsnorm(x) * weight, same shape and dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); x, residual: [N, D]."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    return _launch(x, residual, weight, eps)
