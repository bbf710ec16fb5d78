"""The reference backend: plain PyTorch, runs anywhere, written for clarity rather than speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, ForwardBatch


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first `length` tokens of each request through the page table.

    cache: [num_pages, page_size, KVH, D]; rows: [B] -> [B, length, KVH, D]
    """
    page_size = cache.shape[1]
    num_pages = -(-length // page_size)  # ceil
    pages = page_table[rows.long(), :num_pages].long()  # [B, num_pages]
    return cache[pages].flatten(1, 2)[:, :length]  # [B, num_pages * page_size, KVH, D] -> [B, length, KVH, D]


class TorchBackend(AttentionBackend):
    name = "torch"

    def prefill(self, q, k, v, k_cache, v_cache, fb: ForwardBatch, scale):
        # q: [N, H, D]. One causal attention per request over [its cached prefix + its new tokens].
        out = torch.empty_like(q)
        end = 0
        for b, (prefix, total) in enumerate(zip(fb.prefix_lens_cpu, fb.seq_lens_cpu)):  # host lists: no device sync
            start, end = end, end + total - prefix
            if prefix == 0:  # nothing cached before this pass: the new K/V are all the keys
                kb, vb = k[start:end], v[start:end]  # [T, KVH, D]
            else:
                row = fb.req_rows[b : b + 1]
                kb = gather_kv(k_cache, fb.page_table, row, total)[0]  # [total, KVH, D]
                vb = gather_kv(v_cache, fb.page_table, row, total)[0]
            # query i (position prefix + i) sees keys 0 .. prefix + i: a causal mask shifted by the prefix
            mask = torch.ones(end - start, total, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), attn_mask=mask, scale=scale,
                enable_gqa=True).transpose(0, 1)
        return out  # [N, H, D]

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        # q: [B, H, D]; each request's keys are gathered through the page table, padded to the longest.
        k = gather_kv(k_cache, fb.page_table, fb.req_rows, fb.max_seq_len).transpose(1, 2)  # [B, KVH, L, D]
        v = gather_kv(v_cache, fb.page_table, fb.req_rows, fb.max_seq_len).transpose(1, 2)
        valid = torch.arange(fb.max_seq_len, device=q.device)[None, :] < fb.seq_lens[:, None]  # [B, L]
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :],
                                             scale=scale, enable_gqa=True)
        return out[:, :, 0, :]  # [B, H, D]
