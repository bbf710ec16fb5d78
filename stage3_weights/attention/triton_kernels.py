"""Our own attention kernels, written in Triton: a varlen causal prefill kernel and a split
("flash-decoding") decode kernel, launched by triton_backend.py.

Both kernels compute softmax(q k^T * scale) v without ever holding a whole row of scores. They walk
the keys block by block and keep, per query row, three running values (the "online softmax" of
FlashAttention):

    m   the largest score seen so far                       (so exp() never overflows)
    l   the sum of exp(score - m) over the keys seen so far  (the softmax denominator)
    acc the sum of exp(score - m) * v over the keys seen     (the numerator, a [D] vector per row)

When a new block raises the maximum from m to m_new, everything summed so far was scaled by exp(-m)
instead of exp(-m_new), so it is rescaled by alpha = exp(m - m_new) before the new block is added.
After the last block the answer is acc / l. Exact (not an approximation), one pass over K/V,
O(block) memory instead of O(seq_len).

Decode has one query row per request and head, and is bound by memory, not arithmetic: every step
reads each request's whole K/V cache (seq_len x KVH x D x 2 values per layer) to do about 2
multiply-adds per value read per query head. So the decode grid is shaped around bytes and around
keeping every SM busy (SGLang's `decode_attention.py` "grouped" kernel and FlashDecoding do the
same):

1. The query heads of a group are loaded together. Under GQA, GROUP = H // KVH query heads share one
   K/V head. One program per query head would read each K/V block GROUP times (the L2 cache catches
   some of it, not all); one program per KV head loads it once and multiplies it with the GROUP
   query rows at once: q [GROUP, D] (padded to 16 rows, tl.dot's minimum) x k^T [D, BLOCK_N] is one
   matrix product on tensor cores. GROUP x fewer bytes for the same answer; the padded rows cost
   arithmetic, which decode has to spare.
2. The keys are split. At batch 1 with 8 KV heads that is 8 programs, on a GPU with over 100 SMs,
   each walking a 32k-token context alone. So each request's keys are cut into NUM_KV_SPLITS pieces,
   one program each: grid (B, KVH, NUM_KV_SPLITS), _decode_partial_kernel. Each piece ends with its
   own online-softmax state and stores o = acc / l and lse = m + log2(l) (scratch [B, H,
   NUM_KV_SPLITS, D] and [B, H, NUM_KV_SPLITS], fp32). A second, small kernel (grid (B, H),
   _decode_combine_kernel) merges the pieces with the online softmax's own rescaling: out = sum_s
   2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s. Still exact. The price: writing and
   reading the partials, small next to the cache. NUM_KV_SPLITS is fixed per backend, never derived
   from seq_lens, so the launch does not depend on device data (stage 5 records decode into CUDA
   graphs).

Running on a CPU: Triton compiles for GPUs only, but it ships an *interpreter* that runs the same
kernel code with NumPy, selected by the env var TRITON_INTERPRET=1, read when `@triton.jit`
decorates a function: for our kernels when this module is imported, for triton's own helpers
(tl.sum, tl.max) when triton is first imported. Policy: if torch sees no CUDA GPU, this module does
`os.environ.setdefault("TRITON_INTERPRET", "1")` before importing triton, so `--attention-backend
triton` works on a CPU (slowly: for learning and testing). An explicit TRITON_INTERPRET=0 is
respected; the backend then refuses CPU tensors with a clear error. Under the interpreter the
kernels also compute in fp32 throughout (see _launch_flags and _empty_out in triton_backend.py),
since NumPy has no bfloat16.
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
# Trap: triton.language's own helpers (tl.sum, tl.max) are @triton.jit functions too, decorated when
# triton was FIRST imported. If something imported triton before TRITON_INTERPRET=1 was set
# (torch.compile does, for one), they stay compiled-mode functions that the interpreter cannot call,
# and our kernels fail. Detect it to fail with a clear message. The cure: set TRITON_INTERPRET=1
# before anything imports triton (in the shell, or first thing in main).
INTERPRETER_BROKEN = INTERPRET and isinstance(tl.sum, triton.runtime.JITFunction)

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheaper instruction on GPUs


@triton.jit
def _prefill_kernel(
    Q, K, V, O,  # q, out: [N, H, D]; k, v: [N, KVH, D] (packed prompts)
    cu_seqlens,  # [B+1] int32: request b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1
    qk_scale,  # softmax scale * log2(e): scores come out in base 2, ready for exp2
    stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd, stride_on, stride_oh, stride_od,
    # H // KVH query heads share one K/V head (GQA); 1 = plain multi-head attention
    GROUP: tl.constexpr,
    # BLOCK_D = next power of two >= HEAD_DIM (tl.arange needs it)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query rows / key rows handled per step
    UPCAST: tl.constexpr,  # cast tiles to fp32 before tl.dot (interpreter only, see _launch_flags)
    # "ieee" for fp32 inputs (exact), "tf32" otherwise (ignored for bf16/fp16)
    DOT_PRECISION: tl.constexpr,
):
    # One program = one block of BLOCK_M queries x one query head x one request.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    start = tl.load(cu_seqlens + req)
    seq_len = tl.load(cu_seqlens + req + 1) - start
    m_start = pid_m * BLOCK_M
    if m_start >= seq_len:
        # the grid is sized for the longest prompt; shorter ones have nothing for this program to do
        return
    kv_head = head // GROUP  # GQA: read the shared K/V head in place, no repeat_interleave copy

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions within the request
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_m = offs_m < seq_len  # the last query block may run past the prompt (odd lengths)
    # head_dim 80 or 96 pads to 128: the extra columns load as 0 and add 0 to q.k
    mask_d = offs_d < HEAD_DIM

    q_ptrs = (Q + (start + offs_m)[:, None] * stride_qn + head * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base-2 scores)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)  # running denominator
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)  # running numerator, always fp32

    # Causal: the last query of this block is m_start + BLOCK_M - 1, so keys from m_start + BLOCK_M
    # on are masked for every row of the block: stop there instead of loading them (that skips ~half
    # the work of a prompt).
    k_end = tl.minimum(seq_len, m_start + BLOCK_M)
    for n_start in range(0, k_end, BLOCK_N):
        offs_k = n_start + offs_n  # [BLOCK_N] key positions within the request
        mask_k = offs_k < seq_len
        k_ptrs = K + (
            start + offs_k)[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :] * stride_kd
        v_ptrs = V + (
            start + offs_k)[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :] * stride_vd
        k = tl.load(k_ptrs, mask=mask_k[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # [BLOCK_M, BLOCK_N] fp32
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        # Key j is visible to query i when j <= i (causal) and j is a real key of this request.
        visible = (offs_m[:, None] >= offs_k[None, :]) & mask_k[None, :]
        s = tl.where(visible, s, float("-inf"))

        # Online softmax update. Key 0 is visible to every row (even the padded rows past seq_len,
        # whose output is never stored), and the first block contains it, so m_new is finite from
        # the first step on: no inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        # how much the old sums shrink under the new max (0 on the first block)
        alpha = tl.exp2(m_i - m_new)
        # [BLOCK_M, BLOCK_N] unnormalized probabilities, 0 where masked
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
    V_cache,  # q: [B, H, D]; caches: [num_slots, max_len, KVH, D] (any strides)
    # scratch, fp32: [B, H, NUM_KV_SPLITS, D] each split's own answer, [B, H, NUM_KV_SPLITS] its lse
    Part_O,
    Part_LSE,
    # [B] int32: request b reads cache row slot_ids[b], positions 0 .. seq_lens[b]-1
    slot_ids,
    seq_lens,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    # query rows of the tile: GROUP padded up to a power of two >= 16 (tl.dot's minimum)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program = one request x one KV head x one split of that request's keys, for ALL the query
    # heads of the group: each K/V block is loaded once and used by GROUP query rows (one tl.dot)
    # instead of by one.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # int64: slot * stride_ks can pass 2**31 elements in a big cache; int32 math would wrap around
    # silently.
    slot = tl.load(slot_ids + req).to(tl.int64)
    # includes the token being decoded: its K/V is already in the cache
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

    k_base = K_cache + slot * stride_ks + kv_head * stride_kh
    v_base = V_cache + slot * stride_vs + kv_head * stride_vh
    # the online softmax of one query row per head
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    for n_start in range(split_start, split_end, BLOCK_N):
        offs_k = n_start + offs_n  # [BLOCK_N] key positions
        # no causal mask: the one query is the newest token and sees every cached key
        mask_k = offs_k < split_end
        kv_mask = mask_k[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_k[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_k[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
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
