"""The reference backend: plain PyTorch, runs anywhere, written for clarity rather than speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend


class TorchBackend(AttentionBackend):
    name = "torch"

    def prefill(self, q, k, v, cu_seqlens, max_seqlen, scale):
        # q: [N, H, D]; k, v: [N, KVH, D]. One causal attention per request, on its own slice of the
        # packed batch.
        out = torch.empty_like(q)
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            out[start:end] = _attention(q[start:end], k[start:end], v[start:end], scale,
                                        causal=True)
        return out  # [N, H, D]

    def decode(self, q, k_cache, v_cache, slot_ids, seq_lens, scale):
        # q: [B, H, D]; k_cache, v_cache: [num_slots, max_len, KVH, D]
        B, H, D = q.shape
        max_len = int(seq_lens.max())
        k = k_cache[slot_ids.long(), :max_len]  # [B, max_len, KVH, D]
        v = v_cache[slot_ids.long(), :max_len]
        k = k.repeat_interleave(H // k.shape[2], dim=2).transpose(1, 2)  # [B, H, max_len, D]
        v = v.repeat_interleave(H // v.shape[2], dim=2).transpose(1, 2)
        # Rows are as long as the longest request: mask each request's keys beyond its own length.
        valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [B, max_len]
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v,
                                             attn_mask=valid[:, None, None, :], scale=scale)
        return out[:, :, 0, :]  # [B, H, D]


def _attention(q, k, v, scale, causal):
    """q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]. GQA by repeating each K/V head for its query
    group."""
    H = q.shape[1]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=causal, scale=scale)
    return out.transpose(0, 1)
