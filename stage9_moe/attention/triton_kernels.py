"""Our own attention kernels, written in Triton, now reading K/V through the page table: an extend
kernel and a paged split ("flash-decoding") decode kernel, launched by triton_backend.py.

What changed since stage 2 (the math did not: read stage 2's triton_kernels.py for the online
softmax):

1. Keys are no longer one contiguous row per request. A request's token at position `pos` lives at

       page   = page_table[row, pos // PAGE_SIZE]      (row = req_rows[b]: the request's page-table
                                                       row)
       offset = pos % PAGE_SIZE
       k      = k_cache[page, offset, kv_head, :]      (k_cache: [num_pages, PAGE_SIZE, KVH, D])

   so for each block of BLOCK_N key positions the kernels first load BLOCK_N page ids (the page
   table is tiny and stays in cache), then gather the K/V rows they point to. Consecutive positions
   share a page, so the loads are still mostly contiguous runs of PAGE_SIZE rows. PAGE_SIZE is a
   compile-time constant: with a power of two, `// PAGE_SIZE` and `% PAGE_SIZE` compile to a shift
   and a mask.

2. Prefill became an *extend*. Request b brings T = cu_seqlens[b+1] - cu_seqlens[b] new tokens at
   positions prefix_len .. prefix_len + T - 1 (prefix_len = prefix_lens[b], tokens already cached by
   an earlier chunk). New query i sits at position prefix_len + i and sees every key at `key_pos <=
   prefix_len + i`: stage 2's causal mask shifted right by the prefix. The new tokens' K/V were
   stored into the pool before the call, so the kernel reads prefix and new keys alike through the
   page table and ignores the packed k/v it is given. (SGLang's own extend kernel reads the prefix
   from the pool and the new tokens from the packed k/v, in two loops; one loop is simpler and costs
   one extra trip through the pool for the new tokens.)

3. Decode is stage 2's decode with the slot row replaced by the page lookup of 1: the same grid
   (request x KV head x split of the keys, every query head of a group in one tile), the same
   partials and the same combine kernel.

Running on a CPU: same policy as stage 2. Triton compiles for GPUs only; its interpreter
(TRITON_INTERPRET=1, read when `@triton.jit` runs: for our kernels when this module is imported, for
triton's own helpers when triton is first imported) runs the same code with NumPy. If torch sees no
CUDA GPU this module does `os.environ.setdefault("TRITON_INTERPRET", "1")` before importing triton;
an explicit TRITON_INTERPRET=0 is respected and the backend then refuses CPU tensors with a clear
error. Under the interpreter the kernels compute in fp32 throughout (see _launch_flags and
_empty_out in triton_backend.py), since NumPy has no bfloat16.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must happen before the @triton.jit lines below run
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# What triton itself decided for the kernels of this module (same truthy spellings as triton's env
# parser).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
# Trap (see stage 2): if something imported triton before TRITON_INTERPRET=1 was set, triton's own
# helpers (tl.sum, tl.max) stay compiled-mode functions that the interpreter cannot call. Detect it
# to fail with a clear message.
INTERPRETER_BROKEN = INTERPRET and isinstance(tl.sum, triton.runtime.JITFunction)

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheaper instruction on GPUs


@triton.jit
def _extend_kernel(
    # q, out: [N, H, D] packed new tokens; caches: [num_pages, PAGE_SIZE, KVH, D]
    Q, K_cache, V_cache, O,
    # [B+1] int32: request b's new tokens are rows cu_seqlens[b] .. cu_seqlens[b+1]-1 of q
    cu_seqlens,
    # [B] int32: tokens of request b cached before this pass (its first new token's position)
    prefix_lens,
    # [B] int32 page-table row of each request; [max_rows, max_pages] int32 page ids
    req_rows, page_table,
    qk_scale,  # softmax scale * log2(e): scores come out in base 2, ready for exp2
    stride_qn, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,  # page, slot-in-page, head, dim
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_ptr, stride_ptp,  # page table: row, page index
    # stage 9, a quantized pool: [num_pages, PAGE_SIZE, KVH, 1] float32 scales (page, slot, head)
    K_scale, V_scale, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # H // KVH query heads share one K/V head (GQA)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # BLOCK_D = next power of two >= HEAD_DIM
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # new-token queries / key positions per step
    UPCAST: tl.constexpr,  # cast tiles to fp32 before tl.dot (interpreter only)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for bf16/fp16)
    KV_QUANT: tl.constexpr = False,  # the caches hold int8 / fp8 values, dequantized on load
):
    # One program = one block of BLOCK_M new tokens x one query head x one request.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    start = tl.load(cu_seqlens + req)
    n_new = tl.load(cu_seqlens + req + 1) - start
    m_start = pid_m * BLOCK_M
    if m_start >= n_new:
        return  # the grid is sized for the request with the most new tokens
    prefix = tl.load(prefix_lens + req)
    # keys 0 .. seq_len-1: the cached prefix, then the new tokens themselves
    seq_len = prefix + n_new
    kv_head = head // GROUP
    # int64: page ids times the page stride can pass 2**31 elements in a big pool.
    pt_row = page_table + tl.load(req_rows + req).to(tl.int64) * stride_ptr

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among this request's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_new
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix + offs_m  # [BLOCK_M] the queries' positions in the request

    q_ptrs = (Q + (start + offs_m)[:, None] * stride_qn + head * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # online softmax state, as in stage 2
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    # Causal: the block's last query sits at position prefix + m_start + BLOCK_M - 1; no key past it
    # is visible.
    k_end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    for n_start in range(0, k_end, BLOCK_N):
        pos = n_start + offs_n  # [BLOCK_N] key positions in the request
        mask_k = pos < seq_len
        # The page-table lookup: which page holds each key, and where in that page.
        # [BLOCK_N]
        page = tl.load(pt_row + (pos // PAGE_SIZE) * stride_ptp, mask=mask_k, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = mask_k[:, None] & mask_d[None, :]
        k_ptrs = (K_cache + page[:, None] * stride_kp + slot[:, None] * stride_ks +
                  kv_head * stride_kh + offs_d[None, :] * stride_kd)
        v_ptrs = (V_cache + page[:, None] * stride_vp + slot[:, None] * stride_vs +
                  kv_head * stride_vh + offs_d[None, :] * stride_vd)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if KV_QUANT:  # each key's value times its (token, head) scale: [BLOCK_N] scales a step
            k_s = tl.load(K_scale + page * stride_ksp + slot * stride_kss + kv_head * stride_ksh,
                          mask=mask_k, other=0.0)
            v_s = tl.load(V_scale + page * stride_vsp + slot * stride_vss + kv_head * stride_vsh,
                          mask=mask_k, other=0.0)
            k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & mask_k[None, :]  # the shifted causal mask
        s = tl.where(visible, s, float("-inf"))

        # Online softmax (stage 2). Key 0 is visible to every row and lies in the first block: m_new
        # is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = (O + (start + offs_m)[:, None] * stride_on + head * stride_oh
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _decode_partial_kernel(
    Q,
    K_cache,
    V_cache,  # q: [B, H, D]; caches: [num_pages, PAGE_SIZE, KVH, D] (any strides)
    # scratch, fp32: [B, H, NUM_KV_SPLITS, D] each split's own answer, [B, H, NUM_KV_SPLITS] its lse
    Part_O,
    Part_LSE,
    # [B] int32 row, [B] int32 tokens to attend to, [max_rows, max_pages] int32
    req_rows,
    seq_lens,
    page_table,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ptr,
    stride_ptp,
    # stage 9, a quantized pool: [num_pages, PAGE_SIZE, KVH, 1] float32 scales (page, slot, head)
    K_scale, V_scale, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    # query rows of the tile: GROUP padded up to a power of two >= 16 (tl.dot's minimum)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = False,  # the caches hold int8 / fp8 values, dequantized on load
):
    # One program = one request x one KV head x one split of its keys, for the whole query group, as
    # in stage 2; only the address of key `pos` changed.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pt_row = page_table + tl.load(req_rows + req).to(tl.int64) * stride_ptr
    # includes the token being decoded: its K/V is already in the pool
    seq_len = tl.load(seq_lens + req)

    # This split's keys: [split_start, split_end). The split length is cdiv(seq_len, NUM_KV_SPLITS)
    # rounded up to whole blocks, so no block straddles two splits. Short contexts leave the last
    # splits empty (and a seq_len 0 padding request all of them): their loop runs zero times.
    split_len = ((seq_len + NUM_KV_SPLITS - 1) // NUM_KV_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] row i of the tile is query head kv_head * GROUP + i
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP  # rows GROUP .. BLOCK_H-1 are padding: q = 0 there, never stored
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # the online softmax of one query row per head
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    for n_start in range(split_start, split_end, BLOCK_N):
        pos = n_start + offs_n  # [BLOCK_N] key positions
        # no causal mask: the one query is the newest token and sees every key
        mask_k = pos < split_end
        page = tl.load(pt_row + (pos // PAGE_SIZE) * stride_ptp, mask=mask_k, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = mask_k[:, None] & mask_d[None, :]
        k = tl.load(K_cache + page[:, None] * stride_kp + slot[:, None] * stride_ks +
                    kv_head * stride_kh + offs_d[None, :] * stride_kd, mask=kv_mask,
                    other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            V_cache + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh +
            offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if KV_QUANT:  # as in the extend kernel
            k_s = tl.load(K_scale + page * stride_ksp + slot * stride_kss + kv_head * stride_ksh,
                          mask=mask_k, other=0.0)
            v_s = tl.load(V_scale + page * stride_vsp + slot * stride_vss + kv_head * stride_vsh,
                          mask=mask_k, other=0.0)
            k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_k[None, :], s, float("-inf"))
        # finite: every block the loop visits holds a key of the split
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # The split's own answer acc / l, and lse = m + log2(l): the log (base 2, like the scores) of
    # its share of the softmax denominator. An empty split has l = 0, m = -inf: it stores 0 and lse
    # -inf, i.e. weight 0 in the combine.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    p_offs = req * stride_pb + heads * stride_ph + split * stride_ps  # [BLOCK_H]
    tl.store(Part_O + p_offs[:, None] + offs_d[None, :] * stride_pd, acc / l_safe[:, None],
             mask=mask_h[:, None] & mask_d[None, :])
    tl.store(Part_LSE + req * stride_lb + heads * stride_lh + split * stride_ls,
             m_i + tl.log2(l_safe), mask=mask_h)


@triton.jit
def _decode_combine_kernel(
    Part_O, Part_LSE, O,  # [B, H, NUM_KV_SPLITS, D], [B, H, NUM_KV_SPLITS] (fp32) -> out: [B, H, D]
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    # BLOCK_S: NUM_KV_SPLITS padded to a power of two
    NUM_KV_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program = one request x one query head: merge its NUM_KV_SPLITS partial answers into one.
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_KV_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(Part_LSE + req * stride_lb + head * stride_lh + offs_s * stride_ls, mask=mask_s,
                  other=float("-inf"))  # [BLOCK_S]
    o = tl.load(Part_O + req * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps +
                offs_d[None, :] * stride_pd, mask=mask_s[:, None] & mask_d[None, :],
                other=0.0)  # [BLOCK_S, BLOCK_D]
    # Split s holds o_s = acc_s / l_s and lse_s = m_s + log2(l_s). The whole softmax is sum_s acc_s
    # 2^m_s / sum_s l_s 2^m_s = sum_s o_s 2^lse_s / sum_s 2^lse_s: weights 2^(lse_s - max), as in
    # the online softmax's rescaling (subtracting the max keeps exp2 from overflowing).
    m = tl.max(lse, axis=0)
    # every split empty (seq_len 0): weights 2^-inf = 0, not -inf - -inf = NaN
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m)  # [BLOCK_S], 0 for empty splits
    total = tl.sum(w, axis=0)
    # [BLOCK_D]; zeros for seq_len 0
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(O + req * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(O.dtype.element_ty), mask=mask_d)
