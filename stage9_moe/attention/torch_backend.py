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

Stage 6: requests that share a cached prefix share its pages, so a decode step whose requests all
begin with the same pages (a system prompt) can read those keys once: every query of the batch
attends to the shared prefix in one dense call, each request to its own keys as above, and the two
partial softmaxes are merged by their log-sum-exp (cascade attention, as FlashInfer's;
`decode_cascade`). Without it each of B requests gathers and reads its own copy of the prefix: B
times the memory traffic, which is what a CPU decode step of long shared prompts spends its time on.
Detecting it reads the page table on the host, so it is done on a CPU only (elsewhere it would stall
the device).

Stage 5: a CUDA graph cannot use that layout. Its size and the groups are decided on the host from
this step's lengths, and a graph replays the shapes and host values of its capture forever. So under
capture (graph.py builds a ForwardBatch without metadata) decode takes the padded form: every
request's keys gathered through the page table to the page table's full width, with a mask from the
device's seq_lens (`decode_padded`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv_quant import dequantize_kv
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
    # decode with a prefix every request shares: its slots, read once; the groups above then hold
    # the rest
    shared_kv_indices: torch.Tensor | None = None  # [shared_len]
    # stage 9, a quantized pool: the pool slots of the keys above, whose dequantized copy
    # ([sum(seq_lens), 1, KVH, D]) the kv_indices then index (0, 1, 2, ...)
    pool_slots: torch.Tensor | None = None


# below this, reading the prefix once saves less than the extra pass costs
CASCADE_MIN_SHARED_TOKENS = 64


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


def shared_prefix_len(fb: ForwardBatch) -> int:
    """Tokens (whole pages) at the start of every decode request that sit in the same pages for all
    of them: only the radix cache makes two rows point at one page. Each request keeps at least its
    last key to itself."""
    if fb.page_table.device.type != "cpu" or fb.batch_size < 2:
        return 0
    ps = fb.page_size
    max_pages = (min(fb.seq_lens_cpu) - 1) // ps
    if max_pages * ps < CASCADE_MIN_SHARED_TOKENS:
        return 0
    rows = fb.page_table[fb.req_rows.long(), :max_pages]  # [B, max_pages]
    same = (rows == rows[:1]).all(0)  # [max_pages]
    # pages before the first that differs
    n = max_pages if bool(same.all()) else int(same.int().argmin())
    return n * ps if n * ps >= CASCADE_MIN_SHARED_TOKENS else 0


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
    reads_quantized_kv = True

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        kv_indptr, kv_indices = build_kv_indices(fb)
        pool_slots = None
        if fb.kv_pool.quantized:  # every layer reads a dequantized copy of these keys, in order
            pool_slots = kv_indices
            kv_indices = torch.arange(kv_indptr[-1], device=pool_slots.device)
        fb.attn_metadata = meta = TorchAttnMetadata(kv_indptr, kv_indices, pool_slots=pool_slots)
        if fb.phase != "decode":
            return
        shared = shared_prefix_len(fb)
        if shared:  # the groups cover each request's keys after the shared prefix
            meta.shared_kv_indices = kv_indices[:shared]  # request 0's first keys: everyone's
            own = [n - shared for n in fb.seq_lens_cpu]
            own_indptr = [0, *itertools.accumulate(own)]
            own_indices = torch.cat([
                kv_indices[start + shared:end] for start, end in zip(kv_indptr, kv_indptr[1:])
            ])
            meta.order, meta.decode_groups = plan_decode_groups(own, own_indptr, own_indices)
        else:
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
        if meta is None:  # a CUDA-graph capture: static shapes only
            return self.decode_padded(q, k_cache, v_cache, fb, scale)
        if meta.shared_kv_indices is not None:
            return self.decode_cascade(q, k_cache, v_cache, meta, scale)
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

    def prefill_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch, scale):
        # Gather this pass's keys through the page table, dequantize, and attend as over a float
        # cache whose "pages" are those keys, one token each (kv_indices count 0, 1, 2, ...).
        meta: TorchAttnMetadata = fb.attn_metadata
        k_keys, v_keys = dequantized_keys(k_cache, v_cache, kv_scales, meta.pool_slots, q.dtype)
        # the new tokens as the pool holds them: every backend attends to the same keys
        k_new, v_new = dequantized_keys(k_cache, v_cache, kv_scales, fb.out_cache_loc, q.dtype)
        return self.prefill(q, k_new[:, 0], v_new[:, 0], k_keys, v_keys, fb, scale)  # [N, H, D]

    def decode_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch, scale):
        meta: TorchAttnMetadata = fb.attn_metadata
        if meta is None:  # a CUDA-graph capture: every request padded to the page table's width
            k, v = (dequantize_kv(gather_kv(cache, fb.page_table, fb.req_rows, fb.max_seq_len),
                                  gather_kv(scales, fb.page_table, fb.req_rows, fb.max_seq_len),
                                  q.dtype) for cache, scales in zip((k_cache, v_cache), kv_scales))
            return padded_attention(q, k, v, fb, scale)  # [B, H, D]
        k_keys, v_keys = dequantized_keys(k_cache, v_cache, kv_scales, meta.pool_slots, q.dtype)
        return self.decode(q, k_keys, v_keys, fb, scale)  # [B, H, D]

    def decode_cascade(self, q, k_cache, v_cache, meta: TorchAttnMetadata, scale):
        """Decode when every request starts with the same cached pages: the shared prefix read once
        for the whole batch, each request's own keys by length group, the two partial attentions
        merged by log-sum-exp."""
        B, H, D = q.shape
        KVH = k_cache.shape[2]
        G = H // KVH
        k_all, v_all = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, KVH, D]
        # 1. every query of the batch against the prefix: one [B*G, Lp] score matrix per K/V head
        kp = k_all.index_select(0, meta.shared_kv_indices).transpose(0, 1)  # [KVH, Lp, D]
        vp = v_all.index_select(0, meta.shared_kv_indices).transpose(0, 1)
        qh = q.view(B, KVH, G, D).transpose(0, 1).reshape(KVH, B * G, D)  # [KVH, B*G, D]
        out_p, lse_p = attend(qh, kp, vp, scale)  # [KVH, B*G, D], [KVH, B*G]
        out_p = out_p.view(KVH, B, G, D).transpose(0, 1)  # [B, KVH, G, D]
        lse_p = lse_p.view(KVH, B, G).transpose(0, 1)  # [B, KVH, G]
        # 2. each request against its own keys (sorted by length, in groups, as decode() does)
        qs = q[meta.order].view(B, KVH, G, D)
        outs, lses = [], []
        for group in meta.decode_groups:
            g, L = group.mask.shape[0], group.mask.shape[-1]
            # [g, KVH, L, D]
            k = k_all.index_select(0, group.kv_indices).view(g, L, KVH, D).transpose(1, 2)
            v = v_all.index_select(0, group.kv_indices).view(g, L, KVH, D).transpose(1, 2)
            o, lse = attend(qs[group.first : group.first + g], k, v, scale, group.mask)
            outs.append(o)
            lses.append(lse)
        out_s, lse_s = torch.empty_like(out_p), torch.empty_like(lse_p)
        # back to the batch's order
        out_s[meta.order], lse_s[meta.order] = torch.cat(outs), torch.cat(lses)
        # 3. softmax over prefix + own keys = the two partial results, each weighted by its share of
        #    the mass
        lse = torch.logaddexp(lse_p, lse_s)  # [B, KVH, G]
        out = out_p * (lse_p - lse).exp()[..., None] + out_s * (lse_s - lse).exp()[..., None]
        return out.reshape(B, H, D).to(q.dtype)  # [B, H, D]

    def decode_padded(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        """Every request padded to fb.max_seq_len keys, which graph.py sets to the page table's
        width: shapes that do not depend on the step, and a mask computed on the device, so a replay
        stays right as the requests grow."""
        k = gather_kv(k_cache, fb.page_table, fb.req_rows, fb.max_seq_len)  # [B, L, KVH, D]
        v = gather_kv(v_cache, fb.page_table, fb.req_rows, fb.max_seq_len)
        return padded_attention(q, k, v, fb, scale)  # [B, H, D]


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                     scale: float) -> torch.Tensor:
    """q [B, H, D] against each request's first seq_lens[b] of k, v [B, L, KVH, D] -> [B, H, D]."""
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < fb.seq_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale, enable_gqa=True)
    return out[:, :, 0, :]  # [B, H, D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None):
    """Softmax attention that also returns each query's log-sum-exp, which merging partial results
    needs (SDPA does not return it). q: [..., M, D], k and v: [..., L, D], mask additive -> ([...,
    M, D] float32, [..., M] float32)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [..., M, L]
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)  # [..., M]
    return (scores - lse[..., None]).exp() @ v.float(), lse


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor, rows: torch.Tensor,
              length: int) -> torch.Tensor:
    """Read the first `length` tokens of each request through the page table.

    cache: [num_pages, page_size, KVH, D]; rows: [B] -> [B, length, KVH, D]
    """
    page_size = cache.shape[1]
    num_pages = -(-length // page_size)  # ceil
    pages = page_table[rows.long(), :num_pages].long()  # [B, num_pages]
    # [B, num_pages * page_size, KVH, D] -> [B, length, KVH, D]
    return cache[pages].flatten(1, 2)[:, :length]


def dequantized_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales, slots: torch.Tensor,
                     dtype: torch.dtype) -> list[torch.Tensor]:
    """The K and V at pool `slots` [n] of one layer of a quantized pool, dequantized to dtype:
    [n, 1, KVH, D] each, a float "cache" of n pages of one token."""
    out = []
    for cache, scales in zip((k_cache, v_cache), kv_scales):
        rows = cache.flatten(0, 1).index_select(0, slots)  # [n, KVH, D] int8 / fp8
        out.append(dequantize_kv(rows, scales.flatten(0, 1).index_select(0, slots), dtype)[:, None])
    return out
