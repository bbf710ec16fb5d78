"""q4_1 / q8_0 blocks times activations rounded to int8: --quantization q4_1_a8 / q8_0_a8.

llama.cpp multiplies these files' blocks by activations it first rounds to int8 per block of 32
(its Q8_1 / Q8_0): integer dot products, two float multiplies per block. Lossy (x loses bits),
and faster on a CPU whose float gemv is bound by instructions rather than bytes:

    x block of 32:  dx = max|x| / 127,  xq = round(x * (1 / dx))             (round half to even)
    product:        x W^T computed from xq * dx instead of x

    CPU, <= 16 rows   quant_a8_cpu.cpp: integer dots (AVX512-VNNI's vpdpbusd; plain C++ without it)
    otherwise         x rounded first (`rounded`), then kernels/quant.py's exact paths

Both paths compute one function: the product of the rounded x with the dequantized weight, up to
float32 rounding. How many greedy tokens it keeps is measured in tests/test_stage9_quant.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..attention.cpu_backend import build_extension
from ..quantization import BLOCK, QuantizedWeight

SOURCE = Path(__file__).with_name("quant_a8_cpu.cpp")
METHOD_IDS = {"q4_1": 0, "q8_0": 1}  # as quant_a8_cpu.cpp's Method
GEMV_MAX_ROWS = 16
_ops: list = []
_error: list[str] = []


def load_cpu():
    if not _ops and not _error:
        try:  # the rounding of x must be the reference's: no fused multiply-adds
            build_extension(SOURCE, "quant_a8_cpu", ("-ffp-contract=off", ))
            _ops.append(torch.ops.sglz_quant_a8_cpu)
            torch.library.register_fake("sglz_quant_a8_cpu::quant_gemv_a8")(
                lambda x, data, bias, method: x.new_empty(x.shape[0], data.shape[0]))
            torch.library.register_fake("sglz_quant_a8_cpu::round_a8")(torch.empty_like)
        except RuntimeError as e:
            _error.append(f"the CPU int8-activation kernels did not build: {e}")
    if _error:
        raise RuntimeError(_error[0])
    return _ops[0]


def rounded(x: torch.Tensor) -> torch.Tensor:
    """round_activations(x), by quant_a8_cpu.cpp in one pass on a CPU where it is built."""
    if x.device.type == "cpu" and _ops:
        return _ops[0].round_a8(x.float().contiguous())
    return round_activations(x)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to int8 per block of 32 and back: xq * dx, float32 [M, K]."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)  # [M, K / 32, 32]
    dx = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [M, K / 32, 1]
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return (torch.round(blocks * inv) * dx).reshape(x.shape)


def gemv_a8(x: torch.Tensor, weight: QuantizedWeight,
            bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M <= 16, in] @ W^T (+ b) with integer dots on a CPU -> [M, out] in x's dtype; None
    where this kernel does not run (more rows, another device or backend, no build)."""
    from . import current_backend

    if not (x.device.type == "cpu" and x.shape[0] <= GEMV_MAX_ROWS and _ops
            and current_backend() in ("auto", "cpu")):
        return None
    b = None if bias is None else bias.float().contiguous()
    out = _ops[0].quant_gemv_a8(x.float().contiguous(), weight.data, b, METHOD_IDS[weight.method])
    return out.to(x.dtype)
