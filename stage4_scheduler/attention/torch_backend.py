"""The reference backend: plain PyTorch, runs anywhere. Each request reads exactly its own keys
(varlen).

Once per forward pass, `init_forward_metadata` lays out where every request's keys live, in the
vocabulary of SGLang's flashinfer backend:

    kv_indptr  [B+1]            request b's keys are kv_indices[kv_indptr[b] : kv_indptr[b+1]]
                                (prefix sums)
    kv_indices [sum(seq_lens)]  the pool slot (page * page_size + offset) of every key of every
                                request, in order

Every layer then gathers its K/V with one `index_select` over those slots and never touches the page
table again.

Decode has one query per request. A dense attention per request is B calls per layer, and on a CPU
each call costs more than the arithmetic of a short request; one call over the whole batch pads
every request to the longest (up to ~2x the keys on a mixed batch: twice the gather, twice the
attention). In between, the metadata also sorts the requests by length and cuts them into groups
whose shortest is at least half their longest: one dense attention per group, padded only to the
group's longest (a few groups per step; ~1.2x the real keys on our benchmark's mix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend, ForwardBatch


@dataclass
class DecodeGroup:
    """Decode requests of similar length, attended together as one dense batch padded to the longest
    of them, L. They are requests first .. first + g - 1 of the batch sorted by length."""

    first: int
    # [g * L] pool slots, request by request; a short one repeats its last key as padding
    kv_indices: torch.Tensor
    mask: torch.Tensor  # [g, 1, 1, L] float32: 0 for a request's own keys, -inf for the padding


@dataclass
class TorchAttnMetadata:
    kv_indptr: list[int]  # [B+1] host copy: the loops below slice with it, no device sync
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64 pool slots
    # decode only: the batch sorted by length (order[i] = the request in sorted place i) and cut
    # into groups
    order: torch.Tensor | None = None  # [B]
    decode_groups: list[DecodeGroup] | None = None


def build_kv_indices(fb: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """Every request's key slots through the page table, concatenated: (kv_indptr [B+1], kv_indices
    [total])."""
    kv_indptr = [0]
    for n in fb.seq_lens_cpu:
        kv_indptr.append(kv_indptr[-1] + n)
    dev, ps = fb.seq_lens.device, fb.page_size
    starts = torch.tensor(kv_indptr[:-1], device=dev)  # [B]
    req = torch.repeat_interleave(torch.arange(fb.batch_size, device=dev), fb.seq_lens.long(),
                                  # [total]: the request each key belongs to
                                  output_size=kv_indptr[-1])
    # [total]: the key's position in its request
    pos = torch.arange(kv_indptr[-1], device=dev) - starts[req]
    pages = fb.page_table[fb.req_rows.long()[req], pos // ps].long()  # [total]
    return kv_indptr, pages * ps + pos % ps


def plan_decode_groups(lens: list[int], kv_indptr: list[int], kv_indices: torch.Tensor):
    """Sort the requests by length and cut where a group's longest would exceed twice its
    shortest."""
    dev = kv_indices.device
    order = sorted(range(len(lens)), key=lens.__getitem__)  # shortest first
    groups, first = [], 0
    while first < len(order):
        last = first
        while last + 1 < len(order) and lens[order[last + 1]] <= 2 * lens[order[first]]:
            last += 1
        members = order[first : last + 1]
        L = lens[order[last]]
        g_lens = torch.tensor([lens[b] for b in members], device=dev)[:, None]  # [g, 1]
        g_starts = torch.tensor([kv_indptr[b] for b in members], device=dev)[:, None]
        j = torch.arange(L, device=dev)[None, :]  # [1, L]
        # [g, L] into kv_indices; padding repeats the last key
        idx = g_starts + torch.minimum(j, g_lens - 1)
        # An additive float32 mask (SDPA takes it with any query dtype), made once here: SDPA would
        # otherwise turn a bool mask into one in every layer.
        mask = torch.zeros(len(members), 1, 1, L, dtype=torch.float32, device=dev)
        mask.masked_fill_((j >= g_lens)[:, None, None, :], float("-inf"))
        groups.append(DecodeGroup(first, kv_indices[idx.flatten()], mask))
        first = last + 1
    return torch.tensor(order, device=dev), groups


class TorchBackend(AttentionBackend):
    name = "torch"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        kv_indptr, kv_indices = build_kv_indices(fb)
        fb.attn_metadata = meta = TorchAttnMetadata(kv_indptr, kv_indices)
        if fb.phase == "decode":
            meta.order, meta.decode_groups = plan_decode_groups(fb.seq_lens_cpu, kv_indptr,
                                                                kv_indices)

    def prefill(self, q, k, v, k_cache, v_cache, fb: ForwardBatch, scale):
        # q: [N, H, D]. One causal attention per request over [its cached prefix + its new tokens].
        meta: TorchAttnMetadata = fb.attn_metadata
        out = torch.empty_like(q)
        end = 0
        # host lists: no device sync
        for b, (prefix, total) in enumerate(zip(fb.prefix_lens_cpu, fb.seq_lens_cpu)):
            start, end = end, end + total - prefix
            # [1, H, T, D]: 4-D, which takes SDPA's fused CPU kernel
            qb = q[start:end].transpose(0, 1)[None]
            # nothing cached before this pass: the new K/V are all the keys, plain causal
            if prefix == 0:
                kb, vb = k[start:end], v[start:end]  # [T, KVH, D]
                mask, causal = None, True
            else:
                slots = meta.kv_indices[meta.kv_indptr[b] : meta.kv_indptr[b + 1]]  # [total]
                kb = k_cache.flatten(0, 1).index_select(0, slots)  # [total, KVH, D]
                vb = v_cache.flatten(0, 1).index_select(0, slots)
                # query i (position prefix + i) sees keys 0 .. prefix + i: a causal mask shifted by
                # the prefix
                mask, causal = torch.ones(end - start, total, dtype=torch.bool,
                                          device=q.device).tril(prefix), False
            out[start:end] = F.scaled_dot_product_attention(
                qb,
                kb.transpose(0, 1)[None],
                vb.transpose(0, 1)[None], attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=True)[0].transpose(0, 1)
        return out  # [N, H, D]

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        # q: [B, H, D]. One dense attention per group of similar-length requests (see the module
        # docstring).
        meta: TorchAttnMetadata = fb.attn_metadata
        B, H, D = q.shape
        KVH = k_cache.shape[2]
        # GQA: the G = H // KVH query heads that share a K/V head become G queries of that head, so
        # SDPA reads each key once per K/V head instead of once per query head (and K/V are never
        # repeated). [B, KVH, G, D], sorted by length: groups are slices
        q = q[meta.order].view(B, KVH, H // KVH, D)
        outs = []
        for group in meta.decode_groups:
            g, L = group.mask.shape[0], group.mask.shape[-1]
            k = k_cache.flatten(0, 1).index_select(0, group.kv_indices).view(g, L, KVH,
                                                                             D).transpose(1, 2)
            v = v_cache.flatten(0, 1).index_select(0, group.kv_indices).view(g, L, KVH,
                                                                             D).transpose(1, 2)
            # [g, KVH, G, D]
            outs.append(F.scaled_dot_product_attention(q[group.first : group.first + g], k, v,
                                                       attn_mask=group.mask, scale=scale))
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        out[meta.order] = torch.cat(outs).view(B, H, D)  # back to the batch's order
        return out  # [B, H, D]
