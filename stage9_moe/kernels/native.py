"""The torch implementation of every kernel in this package: what runs on a CPU, and the reference
each Triton kernel is tested against. The first five are, op for op, the code layers.py ran before
the engine had kernels, so a CPU run computes the same bits as before (the golden tests check it).

The two fused-MoE functions take the same sorted-and-padded inputs as their Triton kernels (moe.py's
moe_align_block_size) and compute the same thing with batched matmuls: one [BLOCK_M, K] x [K, N]
product per block of BLOCK_M token slots, the block's expert weights gathered per block. Correct
anywhere, but the gather copies one expert's matrix per block: a fallback, not a fast path (the
benchmark shows it).
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


def _gather_blocks(sorted_token_ids: torch.Tensor, num_blocks: int,
                   num_slots: int) -> tuple[torch.Tensor, ...]:
    # [blocks, BLOCK_M] token slots, padding = num_slots
    ids = sorted_token_ids.view(num_blocks, -1).long()
    valid = ids < num_slots
    return ids, valid, torch.where(valid, ids, 0)


def _scatter_slots(out_blocks: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                   num_slots: int) -> torch.Tensor:
    # Every slot sits in exactly one block row; padding rows go to one extra row that is dropped. No
    # boolean indexing: its output size would need a host sync, which CUDA graphs forbid.
    out = out_blocks.new_empty(num_slots + 1, out_blocks.shape[-1])
    out.index_copy_(0, torch.where(valid, ids, num_slots).flatten(), out_blocks.flatten(0, 1))
    return out[:num_slots]


def fused_moe_gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_token_ids: torch.Tensor,
                      expert_ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """silu(x W1_e^T) * (x W3_e^T) for every token slot, blocked as the Triton kernel does. x: [M,
    H]; w13: [E, 2*I, H] (gate rows, then up rows); -> [M * top_k, I], row s for slot s = token *
    top_k + j."""
    num_slots = x.shape[0] * top_k
    ids, valid, safe = _gather_blocks(sorted_token_ids, expert_ids.numel(), num_slots)
    a = x[safe // top_k]  # [blocks, BLOCK_M, H]: each slot reads its token's row
    w = w13[expert_ids.long()]  # [blocks, 2*I, H]: the block's expert
    gate_up = torch.bmm(a, w.transpose(1, 2))  # [blocks, BLOCK_M, 2*I]
    return _scatter_slots(silu_and_mul(gate_up), ids, valid, num_slots)


def fused_moe_down(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """(inter_s W2_e^T) * routing weight of slot s. inter: [M * top_k, I]; w2: [E, H, I];
    topk_weights: [M, top_k] -> [M * top_k, H] in inter's dtype (the weight is applied in float32
    before rounding, as the kernel does)."""
    num_slots = inter.shape[0]
    ids, valid, safe = _gather_blocks(sorted_token_ids, expert_ids.numel(), num_slots)
    out = torch.bmm(inter[safe], w2[expert_ids.long()].transpose(1, 2))  # [blocks, BLOCK_M, H]
    weights = topk_weights.reshape(-1)[safe].float()  # [blocks, BLOCK_M]
    out = (out.float() * weights[..., None]).to(inter.dtype)
    return _scatter_slots(out, ids, valid, num_slots)
