"""The C++ versions of the elementwise kernels, for CPU tensors (cpu_ops.cpp), and a few-row matmul.

On a CPU the torch versions (native.py) are correct but many: an RMSNorm is ~7 operators, RoPE ~12,
each a pass over memory and a trip through the dispatcher, and a decode step of a small model runs
~40 of them per layer. Written once as a loop over rows, each is one call. They compute what the
torch versions compute, rounded where those round; not bit for bit (a sum of squares is added in
another order, exp/cos/sin may differ in the last bit), which is why the golden tests, not an
equality with native.py, are their check.

`gemv` is the matmul of a small decode batch (up to GEMV_MAX_ROWS rows): layers.linear calls it,
compiled decode included, with a copy of the weight that pack_linear_weights lays out for it once
(`block_for_gemv`).

Built on first use by the same loader as the attention kernels (attention/cpu_backend.py, ~20 s
once, cached). Where no compiler is found, or the build fails, the torch versions run instead:
`unavailable_reason()` says why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..attention.cpu_backend import build_extension

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
DTYPES = (torch.float32, torch.bfloat16)
GEMV_MAX_ROWS = 2  # as in cpu_ops.cpp: from 3 or 4 rows on, oneDNN's kernels are as fast
_ops: list = []
_error: list[str] = []


def load():
    if not _ops and not _error:
        try:  # a * b + c stays two roundings, as in torch
            build_extension(SOURCE, "fused_ops_cpu", ("-ffp-contract=off", ))
            _ops.append(torch.ops.stage9_moe_cpu)  # the operators the build registered
            # its output's shape, for torch.compile, which calls gemv inside a compiled decode
            torch.library.register_fake("stage9_moe_cpu::gemv")(
                lambda x, weight, bias, out_features: x.new_empty(x.shape[0], out_features))
        except RuntimeError as e:
            _error.append(f"the CPU elementwise kernels did not build: {e}")
    if _error:
        raise RuntimeError(_error[0])
    return _ops[0]


def unavailable_reason() -> str | None:
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None


def applies(x: torch.Tensor) -> bool:
    """CPU tensors of a dtype the kernels take, outside torch.compile: stage 5's compiled decode
    fuses the torch versions itself (measured at batch 1 in bfloat16: no faster with these inside
    its graph)."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and not torch.compiler.is_compiling()
            and unavailable_reason() is None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [rows, dim]: a view where the strides allow


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().rmsnorm(_rows(x), weight, eps).view(x.shape)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = load().fused_add_rmsnorm(_rows(x), _rows(residual), weight, eps)
    return out.view(x.shape), res.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return load().silu_and_mul(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = load().rotary_embedding(positions, q, k, inv_freq)
    return q_out, k_out


GEMV_BLOCK = 8  # rows of W per block, as in cpu_ops.cpp


def block_for_gemv(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] laid out as gemv reads it: [out / 8, in / V, 8, V], V = 64 bytes of the dtype
    (16 float32, 32 bfloat16), zero-padded up to whole blocks. Each block of 8 rows is one run of
    memory, its rows interleaved one 64-byte piece (a cache line) at a time (cpu_ops.cpp)."""
    out_features, in_features = weight.shape
    v = 64 // weight.element_size()
    padded = weight.new_zeros(-(-out_features // GEMV_BLOCK) * GEMV_BLOCK, -(-in_features // v) * v)
    padded[:out_features, :in_features] = weight
    blocks = padded.view(-1, GEMV_BLOCK, padded.shape[1] // v, v)  # [out / 8, 8, in / V, V]
    return blocks.transpose(1, 2).contiguous()  # [out / 8, in / V, 8, V]


def gemv(x: torch.Tensor, blocked_weight: torch.Tensor, bias: torch.Tensor | None,
         out_features: int) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) -> [M, out_features], W given as block_for_gemv(W)."""
    return load().gemv(x, blocked_weight, bias, out_features)
