"""The quantized matmul on a GPU: y = x W^T (+ b) with W in q4_1 / q8_0 blocks or int8 rows.

One program computes a [BLOCK_M, BLOCK_N] tile of y. It walks along K one 32-weight block at a
time: loads the tile's BLOCK_N rows of that block (scale, min and packed bytes), dequantizes them
in registers to float32 (q * d + m, as the reference), and accumulates x's [BLOCK_M, 16] halves
against them with tl.dot in float32 ("ieee": no TF32 rounding). The float matrix is never written.
The two fp16 fields of a block are read as two bytes and bitcast (a block's 20 bytes leave them
only 2-byte aligned). Runs on CPU tensors in Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch

from ..quantization import QuantizedWeight
from .triton_utils import check_runnable, tl, triton

METHOD_IDS = {"q4_1": 0, "q8_0": 1, "int8": 2}
BLOCK_BYTES = {0: 20, 1: 34, 2: 32}  # int8: a "block" is 32 consecutive int8 weights


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointer(s) `ptr`, as float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, row_bytes,
                         METHOD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W
    j = tl.arange(0, 16)
    m_ok, n_ok = rm < M, rn < N
    row = w_ptr + rn.to(tl.int64) * row_bytes  # [BLOCK_N] byte pointers
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 32):
        if METHOD == 0:  # q4_1: | d | m | 16 bytes of nibbles |
            blk = row + kb * 20
            d = _fp16_at(blk, n_ok)[:, None]  # [BLOCK_N, 1]
            mn = _fp16_at(blk + 2, n_ok)[:, None]
            qs = tl.load(blk[:, None] + 4 + j[None, :], mask=n_ok[:, None], other=0)  # [BN, 16]
            w_lo = (qs & 0x0F).to(tl.float32) * d + mn
            w_hi = (qs >> 4).to(tl.float32) * d + mn
        elif METHOD == 1:  # q8_0: | d | 32 x int8 |
            blk = row + kb * 34
            d = _fp16_at(blk, n_ok)[:, None]
            lo = tl.load(blk[:, None] + 2 + j[None, :], mask=n_ok[:, None], other=0)
            hi = tl.load(blk[:, None] + 18 + j[None, :], mask=n_ok[:, None], other=0)
            w_lo = lo.to(tl.int8, bitcast=True).to(tl.float32) * d
            w_hi = hi.to(tl.int8, bitcast=True).to(tl.float32) * d
        else:  # int8 rows, one scale per row
            s = tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
            blk = row + kb * 32
            lo = tl.load(blk[:, None] + j[None, :], mask=n_ok[:, None], other=0)
            hi = tl.load(blk[:, None] + 16 + j[None, :], mask=n_ok[:, None], other=0)
            w_lo = lo.to(tl.int8, bitcast=True).to(tl.float32) * s
            w_hi = hi.to(tl.int8, bitcast=True).to(tl.float32) * s
        xk = x_ptr + rm[:, None].to(tl.int64) * K + kb * 32 + j[None, :]  # [BLOCK_M, 16]
        x_lo = tl.load(xk, mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(xk + 16, mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
        acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def triton_quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, computed in float32. int8 rows need K % 32 == 0 here."""
    check_runnable(x)
    method = METHOD_IDS[weight.method]
    M, K = x.shape
    N = weight.out_features
    if K % 32:
        raise ValueError(f"the Triton quantized matmul needs K % 32 == 0, got K={K}")
    x32 = x.float().contiguous()
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    data = weight.data.view(torch.uint8)
    scales = weight.scales if weight.scales is not None else y  # unused unless int8
    b = bias.float().contiguous() if bias is not None else y
    BLOCK_M, BLOCK_N = 16, 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _quant_matmul_kernel[grid](x32, data, scales, b, y, M, N, K, data.shape[1], METHOD=method,
                               HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return y.to(x.dtype)
