"""Attention backends: one interface (base.py), three implementations, picked by name.

- "torch": plain PyTorch (torch_backend.py). Runs anywhere; the reference the others are tested
  against.
- "cpu": prefill and decode that read the paged cache in place, in C++ kernels of our own
  (cpu_backend.py, cpu_kernels.cpp), built on first use. CPU only; the default there.
- "triton": our own kernels (triton_kernels.py, launched by triton_backend.py). The default on
  CUDA; on a CPU it runs in Triton's interpreter.
- "flash_attn": the flash-attention 2 library (flash_attn_backend.py), if installed. CUDA only.

The triton and flash_attn modules are imported only when asked for, so importing the package
never imports triton (slow to import, and on a CPU its interpreter mode must be chosen before the
kernels are defined).
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from .base import AttentionBackend, ForwardBatch
from .torch_backend import TorchBackend

BACKENDS = ("torch", "cpu", "triton", "flash_attn")

__all__ = ["AttentionBackend", "ForwardBatch", "BACKENDS", "available_backends", "default_backend",
           "create_backend"]


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    """None if backend `name` can run on `device`, else a sentence saying why not."""
    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"the cpu backend's kernels run on a CPU, got {device.type}"
        from .cpu_backend import load_kernels

        try:
            load_kernels()
        except RuntimeError as e:
            return str(e)
        return None
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        try:
            from . import triton_backend  # sets TRITON_INTERPRET=1 first when there is no CUDA GPU
        # noqa: BLE001 — a broken install should read as "unavailable", not crash
        except Exception as e:
            return f"triton failed to import ({type(e).__name__}: {e})"
        if device.type != "cuda" and not triton_backend.INTERPRET:
            return (
                f"triton runs on {device.type} only in its interpreter, and TRITON_INTERPRET was "
                "not 1 "
                "when the kernels were defined"
            )
        if triton_backend.INTERPRETER_BROKEN:
            return (
                "triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot "
                "run our kernels"
            )
        return None
    if name == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash_attn is not installed (pip wheels need CUDA)"
        if device.type != "cuda":
            return f"flash_attn needs a CUDA device, got {device.type}"
        try:
            import flash_attn  # noqa: F401
        except ImportError as e:
            return f"flash_attn is installed but failed to import ({e})"
        return None
    raise ValueError(name)


def available_backends(device: torch.device | str) -> list[str]:
    device = torch.device(device)
    return [name for name in BACKENDS if _unavailable_reason(name, device) is None]


def default_backend(device: torch.device | str) -> str:
    """The fast path of the device: our triton kernels on CUDA; on a CPU our C++ kernels (built on
    first use, saying so), or torch where they cannot build (said once, with the reason)."""
    device = torch.device(device)
    if device.type == "cuda" and _unavailable_reason("triton", device) is None:
        return "triton"
    if device.type == "cpu":
        reason = _unavailable_reason("cpu", device)
        if reason is None:
            return "cpu"
        if not _fallback_said:
            _fallback_said.append(reason)
            print(f"[attention: {reason}; using the torch backend instead]", file=sys.stderr)
    return "torch"


_fallback_said: list[str] = []  # the CPU fallback's reason, printed once per process


def create_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    device = torch.device(device)
    if name is None:
        name = default_backend(device)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    reason = _unavailable_reason(name, device)
    if reason is not None:
        raise ValueError(f"{reason}; available here: {', '.join(available_backends(device))}")
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        from .cpu_backend import CpuBackend

        return CpuBackend()
    if name == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend()
    from .flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend()
