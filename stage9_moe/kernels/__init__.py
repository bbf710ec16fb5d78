"""Our own kernels: each one written in Triton, with a torch implementation of the same function.

    rmsnorm, fused_add_rmsnorm     triton_norm.py        layers.RMSNorm
    silu_and_mul                   triton_activation.py  layers' SwiGLU (LlamaMLP)
    rotary_embedding               triton_rope.py        layers.RotaryEmbedding
    qk_norm_rope                   triton_rope.py        Qwen3's q/k norm and RoPE (LlamaAttention)
    fused_moe_gate_up, _down       triton_moe.py         moe.fused_experts (the fused MoE path)

Which one runs ("auto"): Triton on CUDA tensors; on CPU tensors the four elementwise kernels in C++
(cpu.py, cpu_ops.cpp: one call per norm instead of ~7 operators), where they build; torch
everywhere else. On a CPU Triton could run only in its interpreter, far too slow to be a default.
`use_backend("triton")` forces the Triton kernels (on a CPU: in the interpreter, which the tests
do), `use_backend("cpu")` the C++ ones, `use_backend("torch")` the torch versions everywhere: what
the model computed before it had kernels, op for op.

The Triton modules are imported on first use only: `import stage9_moe` never imports triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Iterator

import torch

from . import cpu, native

BACKENDS = ("auto", "triton", "cpu", "torch")
_backend = "auto"

__all__ = [
    "BACKENDS", "use_backend", "current_backend", "use_triton", "use_cpu",
    "triton_unavailable_reason",
    "rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rotary_embedding", "qk_norm_rope",
    "fused_moe_gate_up", "fused_moe_down"
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
    if name == "cpu" and (reason := cpu.unavailable_reason()):
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
    if _backend in ("torch", "cpu"):
        return False
    if _backend == "auto":
        return x.is_cuda and triton_unavailable_reason(x.device) is None
    reason = triton_unavailable_reason(x.device)
    if reason is not None:
        raise RuntimeError(f"kernel backend 'triton' was forced, but {reason}")
    return True


def use_cpu(x: torch.Tensor) -> bool:
    """Should the elementwise kernel for tensor x be the C++ one?"""
    return _backend in ("auto", "cpu") and cpu.applies(x)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from .triton_norm import rmsnorm as triton_rmsnorm

        return triton_rmsnorm(x, weight, eps)
    if use_cpu(x):
        return cpu.rmsnorm(x, weight, eps)
    return native.rmsnorm(x, weight, eps)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from .triton_norm import fused_add_rmsnorm as triton_fused_add_rmsnorm

        return triton_fused_add_rmsnorm(x, residual, weight, eps)
    if use_cpu(x):
        return cpu.fused_add_rmsnorm(x, residual, weight, eps)
    return native.fused_add_rmsnorm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from .triton_activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    if use_cpu(x):
        return cpu.silu_and_mul(x)
    return native.silu_and_mul(x)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        from .triton_rope import rotary_embedding as triton_rotary_embedding

        return triton_rotary_embedding(positions, q, k, inv_freq)
    if use_cpu(q):
        return cpu.rotary_embedding(positions, q, k, inv_freq)
    return native.rotary_embedding(positions, q, k, inv_freq)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: RMSNorm over each head of q and of k, then RoPE; one kernel on a GPU."""
    if use_triton(q):
        from .triton_rope import rotary_embedding as triton_rotary_embedding

        return triton_rotary_embedding(positions, q, k, inv_freq, (q_weight, k_weight, eps))
    if use_cpu(q):  # the C++ norm and RoPE, one after the other
        q, k = cpu.rmsnorm(q, q_weight, eps), cpu.rmsnorm(k, k_weight, eps)
        return cpu.rotary_embedding(positions, q, k, inv_freq)
    return native.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, inv_freq)


def moe_config(num_slots: int, num_experts: int, triton: bool) -> dict:
    """Tile sizes of the fused MoE path (BLOCK_M is also the padding unit of
    moe_align_block_size)."""
    if triton:
        from .triton_moe import moe_config as triton_moe_config

        return triton_moe_config(num_slots, num_experts)
    return dict(BLOCK_M=16 if num_slots <= num_experts else 64)


def fused_moe_gate_up(x, w13, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k: int,
                      config: dict, triton: bool) -> torch.Tensor:
    """[M, H] hidden states -> [M * top_k, I] silu(gate) * up of each token slot under its
    expert."""
    if triton:
        from .triton_moe import fused_moe_gate_up as triton_gate_up

        return triton_gate_up(x, w13, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                              config)
    return native.fused_moe_gate_up(x, w13, sorted_token_ids, expert_ids, top_k)


def fused_moe_down(inter, w2, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                   config: dict, triton: bool) -> torch.Tensor:
    """[M * top_k, I] -> [M * top_k, H]: each slot through its expert's down projection, times its
    routing weight."""
    if triton:
        from .triton_moe import fused_moe_down as triton_down

        return triton_down(inter, w2, topk_weights, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, config)
    return native.fused_moe_down(inter, w2, topk_weights, sorted_token_ids, expert_ids)
