"""The torch implementation of every kernel in this package: what runs on a CPU, and the reference
each Triton kernel is tested against. They are, op for op, the code layers.py ran before the engine
had kernels, so a CPU run computes the same bits as before (the golden tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as Hugging Face does. x: [..., D]."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual add and the next norm in one call. The
    sum is rounded to x's dtype before it is normalised, as `residual = residual + x;
    norm(residual)` does in transformers."""
    residual = x + residual  # [N, D]
    return rmsnorm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2*d] (gate | up) -> silu(gate) * up, [..., d]: SwiGLU's activation."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE: pair (x_i, x_{i+D/2}) of every head turned by positions * inv_freq[i].
    positions: [N]; q: [N, H, D]; k: [N, KVH, D]; inv_freq: [D/2] float32."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    cos = emb.cos().to(q.dtype)[:, None, :]  # [N, 1, D], broadcast over heads
    sin = emb.sin().to(q.dtype)[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention input: RMSNorm over each head of q [N, H, D] and k [N, KVH, D] (one weight
    [D] each, shared by the heads), then RoPE."""
    q, k = rmsnorm(q, q_weight, eps), rmsnorm(k, k_weight, eps)
    return rotary_embedding(positions, q, k, inv_freq)
