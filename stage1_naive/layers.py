"""The building blocks of a Llama decoder layer, written out by hand.

Shapes use: T = tokens in this forward pass, S = tokens in the KV cache after it (S = cached + T),
H = query heads, KVH = key/value heads (GQA: H is a multiple of KVH), D = head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as Hugging Face does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each (x_i, x_{i+D/2}) pair of q and k by an angle position * inv_freq[i].

    Attention scores q.k then depend only on the distance between two positions.
    """

    def __init__(self, head_dim: int, rope_theta: float):
        super().__init__()
        inv_freq = 1.0 / (rope_theta
                          **(torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, H, D]; k: [T, KVH, D]
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = emb.cos().to(q.dtype)[:, None, :]  # [T, 1, D], broadcast over heads
        sin = emb.sin().to(q.dtype)[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention that appends this pass's K/V to the cache and attends over all
    of it."""

    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope_theta: float):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache) -> torch.Tensor:
        T = x.shape[0]  # x: [T, hidden]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q, k = self.rotary(positions, q, k)

        # Store this pass's K/V and read back everything the request has so far.
        k_all, v_all = kv_cache.update(self.layer_id, k, v)  # [S, KVH, D] each
        out = causal_attention(q, k_all, v_all)  # [T, H, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, hidden]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v where query t (the t-th of the T new tokens) sees keys 0 .. S-T+t.

    q: [T, H, D]; k, v: [S, KVH, D] -> [T, H, D]
    """
    T, H, D = q.shape
    S, KVH, _ = k.shape
    # GQA: each group of H // KVH query heads shares one K/V head, so repeat K/V to H heads.
    k = k.repeat_interleave(H // KVH, dim=1)  # [S, H, D]
    v = v.repeat_interleave(H // KVH, dim=1)  # [S, H, D]
    # The new tokens sit at the end of the sequence: query t may see key s when s <= (S - T) + t.
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)  # [T, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )  # [H, T, D]
    return out.transpose(0, 1)  # [T, H, D]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, hidden]
