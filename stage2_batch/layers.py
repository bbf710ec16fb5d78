"""The building blocks of a Llama decoder layer, written out by hand.

Shapes use: N = tokens in this forward pass (all requests of the batch, packed), H = query heads,
KVH = key/value heads (GQA: H is a multiple of KVH), D = head_dim. The attention math itself moved
to attention/.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import ForwardBatch


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
        # positions: [N]; q: [N, H, D]; k: [N, KVH, D]
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos = emb.cos().to(q.dtype)[:, None, :]  # [N, 1, D], broadcast over heads
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        N = x.shape[0]  # x: [N, hidden], the packed tokens of every request in the batch
        q = self.q_proj(x).view(N, self.num_heads, self.head_dim)  # [N, H, D]
        k = self.k_proj(x).view(N, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        v = self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        q, k = self.rotary(positions, q, k)  # positions are per request, so RoPE needs nothing else

        # The backend stores K/V in the cache and attends: varlen over the prompts (prefill), or one
        # query per request against its cache row (decode).
        out = fb.attn_backend.forward(q, k, v, self.layer_id, fb)  # [N, H, D]
        return self.o_proj(out.reshape(N, self.num_heads * self.head_dim))  # [N, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [N, hidden]
