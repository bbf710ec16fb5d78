"""The quantized matmul's paths (quantization.py holds the scheme and the torch reference):

    CPU, <= 16 rows (decode) quant_cpu.cpp's quant_gemv: each weight row's blocks read once,
                             unpacked in registers and used for 4 rows of x at a time; per
                             block d * sum(q x) + m * sum(x) (AVX-512; a scalar loop elsewhere)
    CPU, more rows (prefill) tiles of TILE_ROWS weight rows dequantized by quant_cpu.cpp into a
                             float32 buffer, each multiplied by the float GEMM
    GPU                      triton_quant.py: blocks dequantized in registers inside a tiled GEMM
    otherwise                the reference (dequantize everything, then F.linear)

The tiles and the GPU path dequantize each weight to float32 as the reference does; the gemv
applies a block's scale once per block: the reference's numbers up to float32 rounding. All sum in
float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..attention.cpu_backend import build_extension
from ..quantization import QuantizedWeight, dequantize, quantized_linear_ref

SOURCE = Path(__file__).with_name("quant_cpu.cpp")
METHOD_IDS = {"q4_1": 0, "q8_0": 1, "int8": 2}  # as quant_cpu.cpp's Method
GEMV_MAX_ROWS = 16  # as in quant_cpu.cpp: a decode batch
TILE_ROWS = 2048  # weight rows dequantized at a time for the float GEMM (4.5 MiB at 576 columns)
_ops: list = []
_error: list[str] = []


def load_cpu():
    if not _ops and not _error:
        try:  # quant_dequantize's q * d + m stays two roundings, as in the reference
            build_extension(SOURCE, "quant_cpu", ("-ffp-contract=off", ))
            _ops.append(torch.ops.sglz_quant_cpu)
            # output shapes, for torch.compile (graph.py's compiled decode calls quant_gemv)
            torch.library.register_fake("sglz_quant_cpu::quant_gemv")(
                lambda x, data, scales, bias, method: x.new_empty(x.shape[0], data.shape[0]))
            torch.library.register_fake("sglz_quant_cpu::quant_dequantize")(
                lambda data, scales, method, K: data.new_empty(data.shape[0], K,
                                                               dtype=torch.float32))
        except RuntimeError as e:
            _error.append(f"the CPU quantized kernels did not build: {e}")
    if _error:
        raise RuntimeError(_error[0])
    return _ops[0]


def cpu_unavailable_reason() -> str | None:
    try:
        load_cpu()
    except RuntimeError as e:
        return str(e)
    return None


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def cpu_quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (any float dtype, computed in float32) -> [M, out] in x's dtype."""
    ops, method = load_cpu(), METHOD_IDS[weight.method]
    x32 = x.float().contiguous()
    if x.shape[0] <= GEMV_MAX_ROWS:
        out = ops.quant_gemv(x32, weight.data, weight.scales, _float(bias), method)
        return out.to(x.dtype)
    out = x32.new_empty(x.shape[0], weight.out_features)  # [M, out]
    for start in range(0, weight.out_features, TILE_ROWS):
        rows = slice(start, start + TILE_ROWS)
        scales = None if weight.scales is None else weight.scales[rows]
        tile = ops.quant_dequantize(weight.data[rows], scales, method, weight.in_features)
        out[:, rows] = x32 @ tile.t()  # [M, tile rows]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ W^T (+ b) for a quantized W: the fastest path that runs here."""
    from . import current_backend, use_triton

    dtype = x.dtype
    if weight.int8_activations:  # part 9.12 (quant_a8.py): x rounded to int8 per block first
        from .quant_a8 import gemv_a8, rounded

        out = gemv_a8(x, weight, bias)  # the CPU's integer kernel; None where it does not run
        if out is not None:
            return out
        x = rounded(x)  # float32, for the exact paths below
    if use_triton(x):  # a GPU (or the interpreter, when forced)
        from .triton_quant import triton_quantized_linear

        return triton_quantized_linear(x, weight, bias).to(dtype)
    # _ops: built when the model was quantized (quantize_model), so that a compiled decode
    # (graph.py) traces no build, only the operator call
    if x.device.type == "cpu" and current_backend() in ("auto", "cpu") and _ops:
        return cpu_quantized_linear(x, weight, bias).to(dtype)
    return quantized_linear_ref(x, weight, bias).to(dtype)


def quantized_embedding(input_ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows of a quantized [vocab, hidden] matrix (the tied LM head's): gather the ids' blocks,
    dequantize only those. [N] -> [N, hidden] float32"""
    scales = None if weight.scales is None else weight.scales[input_ids]
    return dequantize(weight.method, weight.data[input_ids], scales)
