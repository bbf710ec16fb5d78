"""SiLU-and-mul in Triton: [N, 2*d] (gate | up) -> silu(gate) * up, [N, d].

Unfused, torch runs silu (reads gate, writes a temporary) and then the multiply (reads both, writes
the result): two launches and an extra [N, d] round trip. Here each program reads a BLOCK of gate
and the matching BLOCK of up, computes in float32 and writes once. The fused MoE kernel
(triton_moe.py) goes one step further and applies the same activation inside its GEMM, so gate and
up are never written at all.
"""

from __future__ import annotations

import torch

from .triton_utils import INTERPRET, check_runnable, empty_out, tl, triton

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g)
    tl.store(Y + row * stride_y + offs, gate * tl.sigmoid(gate) * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    check_runnable(x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = empty_out((x2.shape[0], d), x.dtype, x.device)
    if x2.shape[0] and d:
        block = min(BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, y, x2.stride(0), y.stride(0),
                                                                   d, BLOCK=block)
    return (y.to(x.dtype) if INTERPRET else y).view(*x.shape[:-1], d)
