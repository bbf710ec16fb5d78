"""Our own kernels: each one written in Triton, with a torch implementation of the same function.

    rmsnorm, fused_add_rmsnorm     triton_norm.py        layers.RMSNorm
    silu_and_mul                   triton_activation.py  layers' SwiGLU (LlamaMLP)
    rotary_embedding               triton_rope.py        layers.RotaryEmbedding
    qk_norm_rope                   triton_rope.py        Qwen3's q/k norm and RoPE (LlamaAttention)

Why: a captured decode step is kernel count, not bandwidth, for a small model. In torch each norm is
~8 kernels (cast, square, mean, add, rsqrt, mul, cast, mul), RoPE ~17 (the cos/sin tables, two
rotate_half copies, four products), SwiGLU 2: one Triton kernel each instead (README, 5.8).

Which one runs ("auto"): Triton on CUDA tensors; the torch versions (native.py) on a CPU, where
Triton could run only in its interpreter, far too slow to be a default. `use_backend("triton")`
forces the Triton kernels (on a CPU: in the interpreter, which the tests do), `use_backend("torch")`
the torch versions everywhere: what the model computed before it had kernels, op for op.

The Triton modules are imported on first use only: importing the engine never imports triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Iterator

import torch

from . import native

BACKENDS = ("auto", "triton", "torch")
_backend = "auto"

__all__ = [
    "BACKENDS", "use_backend", "current_backend", "use_triton", "triton_unavailable_reason",
    "rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rotary_embedding", "qk_norm_rope"
]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force one implementation inside the block, for the whole process (every thread, every
    model)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "triton" and (reason := triton_unavailable_reason(torch.device("cpu"),
                                                                 any_device=True)):
        raise RuntimeError(reason)
    old, _backend = _backend, name
    try:
        yield
    finally:
        _backend = old


def current_backend() -> str:
    return _backend


@functools.lru_cache(maxsize=None)
def triton_unavailable_reason(device: torch.device, any_device: bool = False) -> str | None:
    """None if the Triton kernels can run on `device` (any_device: on some device), else a sentence
    saying why."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    try:
        from . import triton_utils  # sets TRITON_INTERPRET=1 first when there is no CUDA GPU
    # noqa: BLE001 — a broken install should read as "unavailable", not crash
    except Exception as e:
        return f"triton failed to import ({type(e).__name__}: {e})"
    if any_device and torch.cuda.is_available():
        return None
    return triton_utils.unavailable_reason(device)


def use_triton(x: torch.Tensor) -> bool:
    """Should the kernel for tensor x be the Triton one? (The rule in the module docstring.)"""
    if _backend == "torch":
        return False
    if _backend == "auto":
        return x.is_cuda and triton_unavailable_reason(x.device) is None
    reason = triton_unavailable_reason(x.device)
    if reason is not None:
        raise RuntimeError(f"kernel backend 'triton' was forced, but {reason}")
    return True


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from .triton_norm import rmsnorm as triton_rmsnorm

        return triton_rmsnorm(x, weight, eps)
    return native.rmsnorm(x, weight, eps)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from .triton_norm import fused_add_rmsnorm as triton_fused_add_rmsnorm

        return triton_fused_add_rmsnorm(x, residual, weight, eps)
    return native.fused_add_rmsnorm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from .triton_activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    return native.silu_and_mul(x)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        from .triton_rope import rotary_embedding as triton_rotary_embedding

        return triton_rotary_embedding(positions, q, k, inv_freq)
    return native.rotary_embedding(positions, q, k, inv_freq)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: RMSNorm over each head of q and of k, then RoPE; one kernel on a GPU."""
    if use_triton(q):
        from .triton_rope import rotary_embedding as triton_rotary_embedding

        return triton_rotary_embedding(positions, q, k, inv_freq, (q_weight, k_weight, eps))
    return native.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, inv_freq)
