"""What every Triton kernel module of this package shares: importing triton the right way, and the
interpreter rules.

Triton compiles for GPUs only. On a CPU its interpreter (TRITON_INTERPRET=1, read when `@triton.jit`
runs) executes the same kernels with NumPy, one program at a time: slow, but the tests run every
kernel that way. As in the attention kernels (attention/triton_kernels.py): if torch sees no CUDA
GPU this module sets TRITON_INTERPRET=1 (unless set already) before importing triton; an explicit
TRITON_INTERPRET=0 is respected and the kernels then refuse CPU tensors with a clear error.

Three interpreter rules, because NumPy has no bfloat16:
- tl.dot on bfloat16 tiles is wrong under the interpreter: UPCAST tiles to float32 first (GPU: no-op
  flag);
- storing float32 into a bfloat16 tensor truncates instead of rounding: kernels write float32
  outputs under the interpreter (empty_out) and torch rounds them (`.to(dtype)`), so the result
  equals a GPU's rounding;
- so does `.to(tl.bfloat16)` inside a kernel: `round_to` rounds to nearest even by hand there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must happen before any @triton.jit line runs

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
# If something imported triton before TRITON_INTERPRET=1 was set, triton's own helpers (tl.sum,
# tl.max) stay compiled-mode functions the interpreter cannot call.
INTERPRETER_BROKEN = INTERPRET and isinstance(tl.sum, triton.runtime.JITFunction)
INTERPRET_FLAG = tl.constexpr(INTERPRET)  # the same, readable inside kernels


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE's precision (round to nearest, ties to even), returned as float32:
    where a computation rounds an intermediate to the model's dtype, as torch does between two
    ops."""
    y = x.to(DTYPE).to(tl.float32)
    if INTERPRET_FLAG:  # compile-time: a GPU build keeps only the line above
        # the interpreter's own cast truncates: keep the top 16 bits, rounded
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True)
    return y


def unavailable_reason(device: torch.device) -> str | None:
    """None if this module's kernels can run on `device`, else why not."""
    if device.type != "cuda" and not INTERPRET:
        return (
            "triton kernels need CUDA tensors unless TRITON_INTERPRET=1 was set before triton was "
            "imported "
            f"(got {device.type})"
        )
    if INTERPRETER_BROKEN:
        return (
            "triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
            "our kernels"
        )
    return None


def check_runnable(*tensors: torch.Tensor) -> None:
    for t in tensors:
        reason = unavailable_reason(t.device)
        if reason is not None:
            raise RuntimeError(reason)


def empty_out(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer: float32 under the interpreter (torch rounds it afterwards), else the wanted
    dtype."""
    return torch.empty(shape, dtype=torch.float32 if INTERPRET else dtype, device=device)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, input_precision) for tl.dot: upcast under the interpreter only; "ieee" keeps float32
    exact on a GPU (TF32 would round the inputs to 10 mantissa bits); bf16/fp16 ignore the precision
    flag."""
    return INTERPRET, "ieee" if dtype == torch.float32 else "tf32"


def row_block(width: int) -> int:
    """The power-of-two tile that covers one row of `width` elements (the tail is masked)."""
    return triton.next_power_of_2(max(width, 1))


def num_warps_for(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8
