"""Stage 4's paged attention backends: the torch reference against a naive formula on contiguous per-request tensors
and its varlen layout against the padded form on random page layouts, our triton kernels against torch (on a CPU
through Triton's interpreter), flash_attn against torch on a GPU, and create_backend's choices. (Stage 5's C++ cpu
backend is checked against the same batches in test_stage5_cpu_attention.py.)

Every batch is built the way the engine lays it out: a pool of random pages (garbage everywhere a request does not
own), each request's pages drawn from a shuffled list (non-contiguous, out of order), page-table rows shuffled too,
unused page-table entries pointing at other requests' pages. Prefix lengths cover 0, partial pages and exact page
multiples; new-token counts 1, 7 and 33. The interpreter is slow: CPU cases stay small.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before anything imports triton (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stage4_scheduler.attention import (  # noqa: E402
    BACKENDS, ForwardBatch, available_backends, create_backend, default_backend)
from stage4_scheduler.attention.torch_backend import TorchBackend  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tb():
    """The triton_backend module, or a clean skip."""
    pytest.importorskip("triton")
    from stage4_scheduler.attention import triton_backend

    if not HAS_CUDA and not triton_backend.INTERPRET:
        pytest.skip("no CUDA and TRITON_INTERPRET was not 1 when triton_backend was imported")
    if triton_backend.INTERPRETER_BROKEN:
        pytest.skip("another module imported triton before TRITON_INTERPRET=1 was set in this process")
    return triton_backend


# ---------------------------------------------------------------- building paged batches


class PoolStub:
    """The part of PagedKVPool that AttentionBackend.forward uses: page_size, layer(), store(). (The backends'
    prefill/decode read only the k_cache/v_cache views and the page table.)"""

    def __init__(self, k_all: torch.Tensor, v_all: torch.Tensor):
        self.k, self.v = k_all, v_all  # [L, num_pages, page_size, KVH, D], possibly strided
        self.page_size = k_all.shape[2]

    def layer(self, layer_id):
        return self.k[layer_id], self.v[layer_id]

    def store(self, layer_id, k, v, out_cache_loc):
        ps = self.page_size
        self.k[layer_id][out_cache_loc // ps, out_cache_loc % ps] = k
        self.v[layer_id][out_cache_loc // ps, out_cache_loc % ps] = v


def paged_batch(reqs, H, KVH, D, page_size, phase="prefill", dtype=torch.float32, device="cpu", layers=2, layer=1,
                page_major=False, q_view=False, seed=0):
    """reqs: [(prefix_len, new_len)] (decode: new_len must be 1). Returns a dict with the ForwardBatch `fb`,
    q ([N, H, D] new tokens), k, v ([N, KVH, D]: the new tokens' K/V, already stored in the pool), the layer views
    k_cache/v_cache ([num_pages, page_size, KVH, D]), the pool, and per request the contiguous keys/values
    `k_full`/`v_full` ([seq_len, KVH, D]) that were scattered into its pages.
    page_major: the pool is allocated [num_pages, L, ...] and transposed, so one layer's view is truly strided.
    q_view: q is a column slice of a fused qkv-like tensor (row stride != H * D)."""
    g = torch.Generator().manual_seed(seed)
    B = len(reqs)
    seq_lens = [p + n for p, n in reqs]
    pages_needed = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 7  # spare pages: garbage no request owns
    max_pages = max(pages_needed) + 2
    shape = (num_pages, layers, page_size, KVH, D) if page_major else (layers, num_pages, page_size, KVH, D)
    k_all = torch.randn(shape, generator=g).to(dtype)  # garbage everywhere: a wrong read cannot go unnoticed
    v_all = torch.randn(shape, generator=g).to(dtype)
    if page_major:
        k_all, v_all = k_all.transpose(0, 1), v_all.transpose(0, 1)
    k_all, v_all = k_all.to(device), v_all.to(device)

    perm = torch.randperm(num_pages, generator=g)  # shuffled page ids, handed out in chunks
    max_rows = B + 3
    rows = torch.randperm(max_rows, generator=g)[:B]  # shuffled page-table rows
    page_table = torch.randint(0, num_pages, (max_rows, max_pages), generator=g, dtype=torch.int32)
    k_full, v_full, q_parts, new_k, new_v, locs, positions = [], [], [], [], [], [], []
    used = 0
    for b, (prefix, new) in enumerate(reqs):
        pages = perm[used : used + pages_needed[b]]
        used += pages_needed[b]
        page_table[rows[b], : len(pages)] = pages.to(torch.int32)
        total = prefix + new
        kf = torch.randn(total, KVH, D, generator=g).to(dtype)
        vf = torch.randn(total, KVH, D, generator=g).to(dtype)
        pos = torch.arange(total)
        slot = pages[pos // page_size] * page_size + pos % page_size  # where position p lives in the pool
        kl, vl = k_all[layer], v_all[layer]
        slot = slot.to(device)
        kl[slot // page_size, slot % page_size] = kf.to(device)  # the prefix AND the new tokens (already stored)
        vl[slot // page_size, slot % page_size] = vf.to(device)
        k_full.append(kf.to(device))
        v_full.append(vf.to(device))
        new_k.append(kf[prefix:])
        new_v.append(vf[prefix:])
        locs.append(slot[prefix:])
        positions.append(pos[prefix:])
    N = sum(n for _, n in reqs)
    width = H + 2 * KVH if q_view else H
    q = torch.randn(N, width, D, generator=g).to(dtype=dtype, device=device)[:, :H]
    if not q_view:
        q = q.contiguous()

    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    new_lens = [n for _, n in reqs]
    cu = [0]
    for n in new_lens:
        cu.append(cu[-1] + n)
    pool = PoolStub(k_all, v_all)
    fb = ForwardBatch(
        phase=phase,
        input_ids=torch.zeros(N, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device),
        out_cache_loc=torch.cat(locs).to(device),
        req_rows=rows.to(torch.int32).to(device),
        prefix_lens=as_i32([p for p, _ in reqs]),
        seq_lens=as_i32(seq_lens),
        cu_seqlens=as_i32(cu),
        max_seqlen=max(new_lens),
        max_seq_len=max(seq_lens),
        prefix_lens_cpu=[p for p, _ in reqs],
        seq_lens_cpu=seq_lens,
        last_token_indices=torch.tensor(cu[1:], device=device) - 1,
        kv_pool=pool,
        page_table=page_table.to(device),
        attn_backend=None,
    )
    kc, vc = pool.layer(layer)
    return dict(fb=fb, q=q, k=torch.cat(new_k).to(device), v=torch.cat(new_v).to(device), k_cache=kc, v_cache=vc,
                pool=pool, layer=layer, k_full=k_full, v_full=v_full)


def extend_reqs(ps):
    """(prefix_len, new_len) mixes for page size ps: fresh prompts, a prefix of exactly 2 pages, partial-page
    prefixes, a single new token after a long prefix."""
    return [(0, 33), (2 * ps, 7), (ps + 1 + ps // 2, 33), (37, 1), (0, 1), (3 * ps - 1, 7)]


def decode_reqs(ps):
    """(prefix_len, 1): seq_lens 1, 7, 33, exactly 3 pages, 2 pages + 1, 60."""
    return [(0, 1), (6, 1), (32, 1), (3 * ps - 1, 1), (2 * ps, 1), (59, 1)]


def naive_attention(q, k, v, scale):
    """softmax(q k^T * scale) v for ONE request, head by head, in float64, causal with queries at the end.
    q: [T, H, D]; k, v: [S, KVH, D] with S >= T. Query i sits at position S - T + i and sees keys 0 .. S - T + i."""
    T, H, _ = q.shape
    S, KVH, _ = k.shape
    out = torch.empty(T, H, q.shape[-1], dtype=torch.float64)
    visible = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # [T, S]
    for h in range(H):
        kh = h // (H // KVH)
        scores = (q[:, h].double().cpu() @ k[:, kh].double().cpu().T) * scale
        out[:, h] = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v[:, kh].double().cpu()
    return out


def max_err(a, b):
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def run(backend, d, scale):
    fb = d["fb"]
    backend.init_forward_metadata(fb)  # what the engine does once per forward pass
    if fb.phase == "prefill":
        return backend.prefill(d["q"], d["k"], d["v"], d["k_cache"], d["v_cache"], fb, scale)
    return backend.decode(d["q"], d["k_cache"], d["v_cache"], fb, scale)


# ---------------------------------------------------------------- the reference itself, against the formula


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("ratio", [1, 3])
def test_torch_extend_matches_naive_formula(page_size, ratio):
    H, KVH, D = 2 * ratio, 2, 16
    reqs = extend_reqs(page_size)
    d = paged_batch(reqs, H, KVH, D, page_size, q_view=True, page_major=(ratio == 3))
    out = run(TorchBackend(), d, D**-0.5)
    assert out.shape == d["q"].shape and out.dtype == d["q"].dtype
    cu = d["fb"].cu_seqlens.tolist()
    for b in range(len(reqs)):
        ref = naive_attention(d["q"][cu[b] : cu[b + 1]], d["k_full"][b], d["v_full"][b], D**-0.5)
        assert max_err(out[cu[b] : cu[b + 1]], ref) < 1e-5, f"request {b} {reqs[b]}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_torch_decode_matches_naive_formula(page_size):
    H, KVH, D = 6, 2, 16
    reqs = decode_reqs(page_size)
    d = paged_batch(reqs, H, KVH, D, page_size, phase="decode")
    out = run(TorchBackend(), d, D**-0.5)
    for b in range(len(reqs)):  # the one query is the newest token: it sees all seq_len keys
        ref = naive_attention(d["q"][b : b + 1], d["k_full"][b], d["v_full"][b], D**-0.5)
        assert max_err(out[b : b + 1], ref) < 1e-5, f"request {b} {reqs[b]}"


# ---------------------------------------------------------------- the varlen layout against the padded form


def random_layout(reqs, H, KVH, D, page_size, phase, shared_pages=0, seed=0):
    """reqs: [(prefix_len, new_len)]. A pool of random values (one layer) read through a random page table: pages
    handed out shuffled, rows shuffled, unused entries pointing anywhere. The first `shared_pages` pages of every
    request are the SAME pages (a prefix shared by all, as a prefix cache makes); they must lie inside every prefix.
    The packed new K/V are what the pool holds at their slots, as after `store`. Returns (q, k, v, k_cache, v_cache,
    fb)."""
    g = torch.Generator().manual_seed(seed)
    B = len(reqs)
    seq_lens = [p + n for p, n in reqs]
    assert all(shared_pages * page_size <= p for p, _ in reqs), "shared pages must hold cached tokens only"
    own = [-(-s // page_size) - shared_pages for s in seq_lens]
    num_pages = shared_pages + sum(own) + 5
    k_cache = torch.randn(num_pages, page_size, KVH, D, generator=g)
    v_cache = torch.randn(num_pages, page_size, KVH, D, generator=g)
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    shared, used = perm[:shared_pages], shared_pages
    max_rows, max_pages = B + 2, max(own) + shared_pages + 3
    rows = torch.randperm(max_rows, generator=g)[:B].to(torch.int32)
    page_table = torch.randint(0, num_pages, (max_rows, max_pages), generator=g, dtype=torch.int32)
    locs, positions = [], []
    for b, (prefix, new) in enumerate(reqs):
        pages = torch.cat([shared, perm[used : used + own[b]]])
        used += own[b]
        page_table[rows[b], : len(pages)] = pages
        pos = torch.arange(prefix, prefix + new)
        locs.append(pages[pos // page_size].long() * page_size + pos % page_size)
        positions.append(pos)
    loc = torch.cat(locs)
    k, v = k_cache.flatten(0, 1)[loc], v_cache.flatten(0, 1)[loc]  # [N, KVH, D]
    new_lens = [n for _, n in reqs]
    cu = torch.tensor([0] + new_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(new_lens), H, D, generator=g)
    fb = ForwardBatch(
        phase=phase, input_ids=torch.zeros(len(loc), dtype=torch.long), positions=torch.cat(positions),
        out_cache_loc=loc, req_rows=rows, prefix_lens=torch.tensor([p for p, _ in reqs], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), cu_seqlens=cu, max_seqlen=max(new_lens),
        max_seq_len=max(seq_lens), prefix_lens_cpu=[p for p, _ in reqs], seq_lens_cpu=seq_lens,
        last_token_indices=cu[1:].long() - 1, kv_pool=SimpleNamespace(page_size=page_size),
        page_table=page_table,
        attn_backend=None)
    return q, k, v, k_cache, v_cache, fb


def padded_reference(q, k, v, k_cache, v_cache, fb, scale):
    """The padded form: every request's keys gathered through the page table to the batch's longest, masked."""
    ps = k_cache.shape[1]
    if fb.phase == "decode":
        L = fb.max_seq_len
        pages = fb.page_table[fb.req_rows.long(), : -(-L // ps)].long()  # [B, pages]
        kp = k_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)  # [B, KVH, L, D]
        vp = v_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)
        valid = torch.arange(L)[None, :] < fb.seq_lens[:, None]  # [B, L]
        return F.scaled_dot_product_attention(q[:, :, None], kp, vp, attn_mask=valid[:, None, None], scale=scale,
                                              enable_gqa=True)[:, :, 0]
    out, cu = torch.empty_like(q), fb.cu_seqlens.tolist()
    for b, (prefix, total) in enumerate(zip(fb.prefix_lens_cpu, fb.seq_lens_cpu)):
        pages = fb.page_table[fb.req_rows[b].long(), : -(-total // ps)].long()
        kb, vb = k_cache[pages].flatten(0, 1)[:total], v_cache[pages].flatten(0, 1)[:total]  # [total, KVH, D]
        mask = torch.ones(total - prefix, total, dtype=torch.bool).tril(prefix)
        out[cu[b] : cu[b + 1]] = F.scaled_dot_product_attention(
            q[cu[b] : cu[b + 1]].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), attn_mask=mask,
            scale=scale, enable_gqa=True).transpose(0, 1)
    return out


VARLEN_DECODE = {  # (prefix_len, 1) each: odd lengths, a one-token request, B=1, lengths far apart (several groups)
    "one-token": [(0, 1)],
    "B=1": [(36, 1)],
    "mixed": [(0, 1), (2, 1), (16, 1), (32, 1), (49, 1), (63, 1), (64, 1), (99, 1), (128, 1), (200, 1)],
    "equal": [(40, 1)] * 5,
}
VARLEN_EXTEND = {  # (prefix_len, new_len): fresh prompts and cached prefixes, a one-token prompt, B=1
    "one-token": [(0, 1)],
    "B=1 with prefix": [(37, 5)],
    "mixed": [(0, 1), (0, 23), (19, 1), (33, 17), (0, 64), (70, 9), (5, 40)],
}


@pytest.mark.parametrize("H, KVH", [(2, 2), (6, 2)])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("phase, name",
                         [("decode", n) for n in VARLEN_DECODE] + [("prefill", n) for n in VARLEN_EXTEND])
def test_varlen_equals_padded_reference(phase, name, page_size, H, KVH):
    reqs = (VARLEN_DECODE if phase == "decode" else VARLEN_EXTEND)[name]
    D, scale = 16, 16**-0.5
    q, k, v, kc, vc, fb = random_layout(reqs, H, KVH, D, page_size, phase, seed=page_size * 10 + H)
    backend = TorchBackend()
    backend.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert meta.kv_indptr == [0] + torch.tensor(fb.seq_lens_cpu).cumsum(0).tolist()
    out = backend.prefill(q, k, v, kc, vc, fb, scale) if phase == "prefill" else backend.decode(q, kc, vc, fb, scale)
    torch.testing.assert_close(out, padded_reference(q, k, v, kc, vc, fb, scale), rtol=1e-5, atol=1e-5)
    if phase == "decode" and name == "mixed":  # lengths 1 .. 201: cut into groups, none padded beyond 2x
        assert len(meta.decode_groups) >= 4
        for group in meta.decode_groups:
            own = (group.mask == 0).sum(-1).flatten()
            assert own.max() <= 2 * own.min() and own.max() == group.mask.shape[-1]


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_varlen_reads_shared_prefix_pages(phase):
    # Every request's first 3 pages are the same pages (a shared prompt prefix); each then has pages of its own.
    reqs = [(13, 1), (25, 1), (40, 1), (12, 1)] if phase == "decode" else [(12, 3), (30, 1), (17, 20)]
    q, k, v, kc, vc, fb = random_layout(reqs, 6, 2, 16, 4, phase, shared_pages=3, seed=3)
    backend = TorchBackend()
    backend.init_forward_metadata(fb)
    slots = fb.attn_metadata.kv_indices
    ptr = fb.attn_metadata.kv_indptr
    first = [slots[ptr[b] : ptr[b] + 12] for b in range(len(reqs))]  # positions 0..11: the shared pages
    assert all(torch.equal(first[0], f) for f in first[1:])
    out = backend.prefill(q, k, v, kc, vc, fb, 0.25) if phase == "prefill" else backend.decode(q, kc, vc, fb, 0.25)
    torch.testing.assert_close(out, padded_reference(q, k, v, kc, vc, fb, 0.25), rtol=1e-5, atol=1e-5)


def test_kv_indices_are_each_requests_own_slots():
    # The layout itself: request b's keys are exactly the pool slots of its positions 0 .. seq_len-1, in order.
    reqs = [(6, 1), (0, 1), (20, 1)]
    q, k, v, kc, vc, fb = random_layout(reqs, 2, 2, 8, 4, "decode", seed=5)
    TorchBackend().init_forward_metadata(fb)
    meta = fb.attn_metadata
    for b, s in enumerate(fb.seq_lens_cpu):
        pos = torch.arange(s)
        want = fb.page_table[fb.req_rows[b], pos // 4].long() * 4 + pos % 4
        assert torch.equal(meta.kv_indices[meta.kv_indptr[b] : meta.kv_indptr[b + 1]], want)
    assert meta.kv_indices.numel() == sum(fb.seq_lens_cpu)  # no padding in the layout


# ---------------------------------------------------------------- our triton kernels against torch (CPU: interpreter)

# (kv-head ratio, head_dim, page_size): GQA ratios 1..4, head dims 16, 64, 80 (not a power of two), pages 1, 4, 16.
CASES = [(1, 16, 4), (2, 80, 16), (3, 64, 1), (4, 64, 16)]


@pytest.mark.parametrize("ratio, D, page_size", CASES)
@pytest.mark.parametrize("blocks", [(None, None), (16, 16)], ids=["default-blocks", "small-blocks"])
def test_triton_extend_matches_torch(tb, ratio, D, page_size, blocks):
    # small-blocks: up to 3 query blocks and 5 key blocks per request: online-softmax rescaling across blocks, key
    # blocks that straddle pages, and query blocks that stop early (causal) all happen.
    H, KVH = 2 * ratio, 2
    d = paged_batch(extend_reqs(page_size), H, KVH, D, page_size, q_view=(ratio == 2), page_major=(ratio == 3))
    out = run(tb.TritonBackend(*blocks), d, D**-0.5)
    ref = run(TorchBackend(), d, D**-0.5)
    assert out.shape == ref.shape and out.dtype == d["q"].dtype
    assert max_err(out, ref) < 1e-4


@pytest.mark.parametrize("ratio, D, page_size", CASES)
def test_triton_decode_matches_torch(tb, ratio, D, page_size):
    H, KVH = 2 * ratio, 2
    d = paged_batch(decode_reqs(page_size), H, KVH, D, page_size, phase="decode", page_major=(ratio % 2 == 1))
    # One layer of the 5-D pool, read in place: mid-storage, and for page_major through non-contiguous strides.
    assert d["k_cache"].storage_offset() > 0 and d["k_cache"].is_contiguous() != (ratio % 2 == 1)
    out = run(tb.TritonBackend(decode_block_n=16), d, D**-0.5)
    ref = run(TorchBackend(), d, D**-0.5)
    assert out.shape == ref.shape and out.dtype == d["q"].dtype
    assert max_err(out, ref) < 1e-4


# The flash-decoding shape through the page table: (GROUP = H // KVH, KVH, head_dim, page_size, num_kv_splits,
# seq_lens). seq_lens at page boundaries (ps - 1, ps, ps + 1, 2 ps), 1, lengths below the number of splits, and a
# seq_len 0 padding row (its page-table row still points at a page holding a token: reading it would show). With
# 16-key blocks, a 70-token context in 4 splits is [0, 32), [32, 64), [64, 70) and one empty split; blocks straddle
# pages of 4.
PAGED_DECODE_CASES = [
    (1, 2, 32, 4, 1, [1]),
    (2, 2, 48, 16, 3, [16, 0, 2]),
    (3, 1, 64, 4, 4, [1, 70, 4, 5, 8, 17]),
    (4, 2, 80, 1, 8, [7, 0, 50, 3, 1, 69, 16]),
    (8, 1, 128, 16, 2, [33, 1, 70, 0]),
    (3, 3, 64, 4, 16, [3, 70]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group, KVH, D, page_size, splits, lens", PAGED_DECODE_CASES,
                         ids=[f"group{c[0]}-d{c[2]}-page{c[3]}-splits{c[4]}-b{len(c[5])}" for c in PAGED_DECODE_CASES])
def test_triton_flash_decoding_matches_torch(tb, group, KVH, D, page_size, splits, lens, dtype):
    H = group * KVH
    # Padding rows are built as 1-token requests, then given seq_len 0, as a CUDA-graph batch pads its rows.
    d = paged_batch([(max(n, 1) - 1, 1) for n in lens], H, KVH, D, page_size, phase="decode", dtype=dtype,
                    page_major=(group % 2 == 1))
    fb = d["fb"]
    fb.seq_lens = torch.tensor(lens, dtype=torch.int32)
    fb.seq_lens_cpu = list(lens)
    out = run(tb.TritonBackend(decode_block_n=16, num_kv_splits=splits), d, D**-0.5)
    d32 = dict(d, q=d["q"].float(), k_cache=d["k_cache"].float(), v_cache=d["v_cache"].float())
    ref = run(TorchBackend(), d32, D**-0.5)
    assert out.shape == (len(lens), H, D) and out.dtype == dtype
    assert not out.isnan().any()
    pad = torch.tensor(lens) == 0
    assert (out[pad] == 0).all()  # a padding row attends to nothing: zeros, whatever the reference's convention
    if dtype == torch.float32:
        assert max_err(out[~pad], ref[~pad]) < 1e-5
    else:  # fp32 math inside, one final rounding to bf16: within half a bf16 ulp of the fp32 answer
        assert ((out.float() - ref).abs()[~pad] <= ref.abs()[~pad] * 2**-8 + 1e-6).all()


def test_triton_num_kv_splits_is_checked(tb):
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_kv_splits must be an integer >= 1"):
            tb.TritonBackend(num_kv_splits=bad)


def test_triton_forward_stores_then_reads_through_pages(tb):
    # The whole AttentionBackend.forward path: the new tokens' pool slots start out as garbage, forward stores the
    # new K/V there, then the extend reads them back through the page table (it never looks at the packed k/v).
    H, KVH, D, ps = 4, 2, 32, 4
    reqs = [(0, 9), (5, 7), (8, 1)]
    results = []
    for backend in (tb.TritonBackend(16, 16), TorchBackend()):
        d = paged_batch(reqs, H, KVH, D, ps)
        fb, L = d["fb"], d["layer"]
        kc, vc = d["k_cache"], d["v_cache"]
        loc = fb.out_cache_loc
        kc[loc // ps, loc % ps] = torch.randn(loc.numel(), KVH, D)  # un-store the new tokens
        vc[loc // ps, loc % ps] = torch.randn(loc.numel(), KVH, D)
        backend.init_forward_metadata(fb)
        results.append(backend.forward(d["q"], d["k"], d["v"], L, fb))
    assert max_err(*results) < 1e-4
    d = paged_batch(reqs, H, KVH, D, ps)  # and the same as the formula on the contiguous tensors
    cu = d["fb"].cu_seqlens.tolist()
    for b in range(len(reqs)):
        ref = naive_attention(d["q"][cu[b] : cu[b + 1]], d["k_full"][b], d["v_full"][b], D**-0.5)
        assert max_err(results[0][cu[b] : cu[b + 1]], ref) < 1e-4


def test_triton_bf16_on_cpu(tb):
    # bf16 under the interpreter (tiles cast to fp32, final rounding by torch): equal to the fp32 attention of the same
    # bf16 inputs up to bf16 rounding (half an ulp).
    H, KVH, D, ps = 4, 2, 64, 4
    for phase, reqs in (("prefill", [(0, 5), (9, 20)]), ("decode", [(2, 1), (40, 1)])):
        d = paged_batch(reqs, H, KVH, D, ps, phase=phase, dtype=torch.bfloat16)
        out = run(tb.TritonBackend(16, 16, decode_block_n=16), d, D**-0.5)
        d32 = dict(d, q=d["q"].float(), k=d["k"].float(), v=d["v"].float(), k_cache=d["k_cache"].float(),
                   v_cache=d["v_cache"].float())
        ref = run(TorchBackend(), d32, D**-0.5)
        assert out.dtype == torch.bfloat16
        assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all(), phase


def test_triton_refuses_int64_metadata(tb):
    d = paged_batch([(3, 2)], 2, 2, 16, 4)
    d["fb"].page_table = d["fb"].page_table.long()
    with pytest.raises(TypeError, match="page_table must be int32"):
        run(tb.TritonBackend(), d, 0.25)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter default applies only where there is no CUDA")
def test_triton_backend_runs_on_cpu_in_a_fresh_process():
    pytest.importorskip("triton")
    # The real user path: no TRITON_INTERPRET in the environment, `--attention-backend triton` on a CPU.
    code = textwrap.dedent("""
        import sys, torch
        from stage4_scheduler.attention import create_backend
        assert "triton" not in sys.modules, "importing the package imported triton"
        tr, ref = create_backend("triton", "cpu"), create_backend("torch", "cpu")  # before the test module's setdefault
        from tests.test_stage4_attention import paged_batch, run, max_err
        d = paged_batch([(0, 3), (6, 4)], 4, 2, 32, 4)
        err = max_err(run(tr, d, 0.2), run(ref, d, 0.2))
        assert err < 1e-5, err
        print("ok", type(tr).__name__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok TritonBackend" in res.stdout


# ---------------------------------------------------------------- choosing a backend; flash_attn's limits


def test_create_backend_choices_and_errors():
    assert BACKENDS == ("torch", "triton", "flash_attn")  # stage 4 has no C++: the cpu backend is stage 5's
    assert default_backend("cpu") == "torch"
    assert create_backend(None, "cpu").name == "torch"
    assert "torch" in available_backends("cpu") and "flash_attn" not in available_backends("cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'cpu'"):
        create_backend("cpu", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_backend("nope", "cpu")
    with pytest.raises(ValueError, match=r"flash_attn .*available here: torch"):
        create_backend("flash_attn", "cpu")


def test_flash_attn_backend_explains_a_missing_install():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    from stage4_scheduler.attention.flash_attn_backend import FlashAttnBackend

    with pytest.raises(ImportError, match="pip wheels need CUDA"):
        FlashAttnBackend()


def test_flash_attn_refuses_small_pages_and_fp32():
    # A static check, so it runs without flash_attn installed.
    from stage4_scheduler.attention.flash_attn_backend import FlashAttnBackend

    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    for ps in (1, 16, 128):
        with pytest.raises(ValueError, match=f"multiple of 256 \\(got page_size {ps}\\)"):
            FlashAttnBackend.check_inputs(q, torch.zeros(8, ps, 2, 64, dtype=torch.bfloat16))
    FlashAttnBackend.check_inputs(q, torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16))  # accepted
    with pytest.raises(TypeError, match="float16/bfloat16 only"):
        FlashAttnBackend.check_inputs(q.float(), torch.zeros(2, 256, 2, 64))


# ---------------------------------------------------------------- GPU (skipped without CUDA)

GPU_EXTEND = [(0, 1), (0, 1000), (2048, 17), (300, 500), (4097, 1), (77, 2048), (1500, 128)]
GPU_DECODE = [(0, 1), (2047, 1), (76, 1), (1499, 1), (511, 1), (2, 1), (3999, 1), (1023, 1)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, KVH, D, page_size", [(32, 8, 128, 16), (9, 3, 64, 1), (16, 16, 80, 64),
                                                   (8, 2, 256, 16)])
def test_triton_matches_torch_on_cuda(tb, dtype, tol, H, KVH, D, page_size):
    # Both compared with the fp32 attention of the same (possibly bf16) inputs.
    for phase, reqs in (("prefill", GPU_EXTEND), ("decode", GPU_DECODE)):
        d = paged_batch(reqs, H, KVH, D, page_size, phase=phase, dtype=dtype, device="cuda", q_view=True)
        d32 = dict(d, q=d["q"].float(), k=d["k"].float(), v=d["v"].float(), k_cache=d["k_cache"].float(),
                   v_cache=d["v_cache"].float())
        ref = run(TorchBackend(), d32, D**-0.5)
        out = run(tb.TritonBackend(), d, D**-0.5)
        assert out.dtype == dtype and max_err(out, ref) < tol, phase


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 8, 16])
@pytest.mark.parametrize("H, KVH, D, page_size", [(32, 8, 128, 16), (9, 3, 64, 1), (8, 1, 80, 64)])
def test_flash_decoding_splits_on_cuda(tb, splits, H, KVH, D, page_size):
    # The compiled kernels (tl.dot on [16, D] group tiles, the combine) with 1..16 splits, through the page table: a
    # padding row, a 1-token context, lengths below the split count, long ones; bf16, against fp32 attention.
    lens = [0, 1, 5, 8191, 16, 3000, 8192]
    d = paged_batch([(max(n, 1) - 1, 1) for n in lens], H, KVH, D, page_size, phase="decode", dtype=torch.bfloat16,
                    device="cuda")
    d["fb"].seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    d["fb"].seq_lens_cpu = list(lens)
    d32 = dict(d, q=d["q"].float(), k_cache=d["k_cache"].float(), v_cache=d["v_cache"].float())
    ref = run(TorchBackend(), d32, D**-0.5)
    out = run(tb.TritonBackend(num_kv_splits=splits), d, D**-0.5)
    pad = torch.tensor(lens, device="cuda") == 0
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and (out[pad] == 0).all()
    assert max_err(out[~pad], ref[~pad]) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("H, KVH, D", [(32, 8, 128), (9, 3, 64)])
def test_flash_attn_matches_torch_on_cuda(H, KVH, D):
    pytest.importorskip("flash_attn")
    fa = create_backend("flash_attn", "cuda")
    for phase, reqs in (("prefill", GPU_EXTEND), ("decode", GPU_DECODE)):
        d = paged_batch(reqs, H, KVH, D, 256, phase=phase, dtype=torch.bfloat16, device="cuda")
        d32 = dict(d, q=d["q"].float(), k=d["k"].float(), v=d["v"].float(), k_cache=d["k_cache"].float(),
                   v_cache=d["v_cache"].float())
        ref = run(TorchBackend(), d32, D**-0.5)
        assert max_err(run(fa, d, D**-0.5), ref) < 2e-2, phase


@pytest.mark.cuda
def test_default_backend_on_cuda_is_triton(tb):
    assert default_backend("cuda") == "triton"
    assert create_backend(None, "cuda").name == "triton"
