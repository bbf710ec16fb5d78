"""Our own attention kernels, written in Triton: a varlen causal prefill kernel and a decode kernel.

Both kernels compute softmax(q k^T * scale) v without ever holding a whole row of scores. They walk the keys block by
block and keep, per query row, three running values (the "online softmax" of FlashAttention):

    m   the largest score seen so far                       (so exp() never overflows)
    l   the sum of exp(score - m) over the keys seen so far  (the softmax denominator)
    acc the sum of exp(score - m) * v over the keys seen     (the numerator, a [D] vector per row)

When a new block raises the maximum from m to m_new, everything summed so far was scaled by exp(-m) instead of
exp(-m_new), so it is rescaled by alpha = exp(m - m_new) before the new block is added. After the last block the
answer is acc / l. Exact (not an approximation), one pass over K/V, O(block) memory instead of O(seq_len).

Running on a CPU: Triton compiles for GPUs only, but it ships an *interpreter* that runs the same kernel code with
NumPy, selected by the env var TRITON_INTERPRET=1, read when `@triton.jit` decorates a function: for our kernels
when this module is imported, for triton's own helpers (tl.sum, tl.max) when triton is first imported. Policy: if
torch sees no CUDA GPU, this module does `os.environ.setdefault("TRITON_INTERPRET", "1")` before importing triton,
so `--attention-backend triton` works on a CPU (slowly: for learning and testing). An explicit TRITON_INTERPRET=0 is
respected; the backend then refuses CPU tensors with a clear error. Under the interpreter the kernels also compute in
fp32 throughout (see _launch_flags and _empty_out), since NumPy has no bfloat16.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must happen before the @triton.jit lines below run

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .base import AttentionBackend  # noqa: E402

# What triton itself decided for the kernels of this module (same truthy spellings as triton's env parser).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
# Trap: triton.language's own helpers (tl.sum, tl.max) are @triton.jit functions too, decorated when triton was FIRST
# imported. If something imported triton before TRITON_INTERPRET=1 was set (torch.compile does, for one), they stay
# compiled-mode functions that the interpreter cannot call, and our kernels fail. Detect it to fail with a clear
# message. The cure: set TRITON_INTERPRET=1 before anything imports triton (in the shell, or first thing in main).
INTERPRETER_BROKEN = INTERPRET and isinstance(tl.sum, triton.runtime.JITFunction)

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheaper instruction on GPUs


@triton.jit
def _prefill_kernel(
    Q, K, V, O,  # q, out: [N, H, D]; k, v: [N, KVH, D] (packed prompts)
    cu_seqlens,  # [B+1] int32: request b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1
    qk_scale,  # softmax scale * log2(e): scores come out in base 2, ready for exp2
    stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd, stride_on, stride_oh, stride_od,
    GROUP: tl.constexpr,  # H // KVH query heads share one K/V head (GQA); 1 = plain multi-head attention
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # BLOCK_D = next power of two >= HEAD_DIM (tl.arange needs it)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query rows / key rows handled per step
    UPCAST: tl.constexpr,  # cast tiles to fp32 before tl.dot (interpreter only, see _launch_flags)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact), "tf32" otherwise (ignored for bf16/fp16)
):
    # One program = one block of BLOCK_M queries x one query head x one request.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    start = tl.load(cu_seqlens + req)
    seq_len = tl.load(cu_seqlens + req + 1) - start
    m_start = pid_m * BLOCK_M
    if m_start >= seq_len:
        return  # the grid is sized for the longest prompt; shorter ones have nothing for this program to do
    kv_head = head // GROUP  # GQA: read the shared K/V head in place, no repeat_interleave copy

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions within the request
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_m = offs_m < seq_len  # the last query block may run past the prompt (odd lengths)
    mask_d = offs_d < HEAD_DIM  # head_dim 80 or 96 pads to 128: the extra columns load as 0 and add 0 to q.k

    q_ptrs = Q + (start + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base-2 scores)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)  # running denominator
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)  # running numerator, always fp32

    # Causal: the last query of this block is m_start + BLOCK_M - 1, so keys from m_start + BLOCK_M on are masked
    # for every row of the block: stop there instead of loading them (that skips ~half the work of a prompt).
    k_end = tl.minimum(seq_len, m_start + BLOCK_M)
    for n_start in range(0, k_end, BLOCK_N):
        offs_k = n_start + offs_n  # [BLOCK_N] key positions within the request
        mask_k = offs_k < seq_len
        k_ptrs = K + (start + offs_k)[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :] * stride_kd
        v_ptrs = V + (start + offs_k)[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :] * stride_vd
        k = tl.load(k_ptrs, mask=mask_k[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        # Key j is visible to query i when j <= i (causal) and j is a real key of this request.
        visible = (offs_m[:, None] >= offs_k[None, :]) & mask_k[None, :]
        s = tl.where(visible, s, float("-inf"))

        # Online softmax update. Key 0 is visible to every row (even the padded rows past seq_len, whose output is
        # never stored), and the first block contains it, so m_new is finite from the first step on: no inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # how much the old sums shrink under the new max (0 on the first block)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N] unnormalized probabilities, 0 where masked
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = O + (start + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _decode_kernel(
    Q, K_cache, V_cache, O,  # q, out: [B, H, D]; caches: [num_slots, max_len, KVH, D] (any strides)
    slot_ids, seq_lens,  # [B] int32: request b reads cache row slot_ids[b], positions 0 .. seq_lens[b]-1
    qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kt, stride_kh, stride_kd,
    stride_vs, stride_vt, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program = one request x one query head: a single query vector against that request's cached keys.
    # (The GROUP heads sharing a K/V head each read the same K rows; the GPU's L2 cache absorbs most of that.
    # Production kernels give one program a whole group, or split the keys across programs ("split-K") when the
    # batch is too small to fill the GPU; this one keeps to the simple form.)
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    # int64: slot * stride_ks can pass 2**31 elements in a big cache; int32 math would wrap around silently.
    slot = tl.load(slot_ids + req).to(tl.int64)
    seq_len = tl.load(seq_lens + req)  # includes the token being decoded: its K/V is already in the cache

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + req * stride_qb + head * stride_qh + offs_d * stride_qd, mask=mask_d, other=0.0)
    q = q.to(tl.float32)  # [BLOCK_D]; one row is a dot product, not a matmul, so no tl.dot here: plain fp32 math

    k_base = K_cache + slot * stride_ks + kv_head * stride_kh
    v_base = V_cache + slot * stride_vs + kv_head * stride_vh
    m_i = float("-inf")  # scalars this time: one query row
    l_i = 0.0
    acc = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    for n_start in range(0, seq_len, BLOCK_N):
        offs_k = n_start + offs_n
        mask_k = offs_k < seq_len  # no causal mask: the one query is the newest token and sees every cached key
        kv_mask = mask_k[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_k[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_k[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * qk_scale  # [BLOCK_N]
        s = tl.where(mask_k, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: block 0 holds key 0, and seq_len >= 1 here
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)  # [BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new

    l_i = tl.where(l_i > 0, l_i, 1.0)  # seq_len == 0 (an empty padding request) writes zeros, not 0/0 = NaN
    tl.store(O + req * stride_ob + head * stride_oh + offs_d * stride_od, (acc / l_i).to(O.dtype.element_ty),
             mask=mask_d)


def _launch_flags(dtype: torch.dtype) -> tuple[bool, str]:
    # UPCAST only under the interpreter: it emulates tl.dot with NumPy, which has no bfloat16, and gets bf16 tiles
    # wrong. On a GPU a bf16 x bf16 -> fp32 tl.dot is exactly what tensor cores do best, so we keep it there.
    # DOT_PRECISION: on GPUs tl.dot rounds fp32 inputs to tf32 (10-bit mantissa) by default, ~1e-3 relative
    # error; "ieee" keeps fp32 runs as exact as torch's own fp32 attention (slower, but fp32 is for checking).
    return INTERPRET, "ieee" if dtype == torch.float32 else "tf32"


def _prefill_config(BLOCK_D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Bigger tiles reuse each loaded K/V row for more queries, but the
    fp32 accumulator [BLOCK_M, BLOCK_D] and the score tile live in registers: too big and they spill to slow local
    memory. Picked by compiling for sm_80 without a GPU and reading ptxas's register/spill counts (no spills, except
    112-224 bytes at head_dim 256; shared memory <= 84 KB, within consumer GPUs' ~99 KB), NOT by benchmarking:
    retune on a GPU if prefill speed matters."""
    if INTERPRET:
        return 64, 64, 4, 1  # the interpreter runs each program as a Python loop: fewer, bigger tiles are faster
    if dtype == torch.float32:  # fp32 tiles are twice the bytes, and "ieee" dots run on CUDA cores, not tensor cores
        return (32, 32, 4, 2) if BLOCK_D <= 64 else (16, 32, 4, 2)
    if BLOCK_D <= 64:
        return 64, 64, 4, 2
    if BLOCK_D <= 128:
        return 64, 64, 8, 2
    return 64, 32, 8, 2


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    # The interpreter converts fp32 -> bf16/fp16 by truncating (round toward zero, up to 1 ulp off) where GPUs and
    # torch round to nearest. So under the interpreter the kernels write fp32 and torch does the final rounding.
    return torch.empty(q.shape, dtype=torch.float32 if INTERPRET else q.dtype, device=q.device)


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None, decode_block_n: int | None = None):
        # None = a default picked per head_dim at launch. Tests pass small blocks to exercise the multi-block paths.
        self.block_m, self.block_n, self.decode_block_n = block_m, block_n, decode_block_n

    @staticmethod
    def _check(*tensors: torch.Tensor) -> int:
        if tensors[0].device.type != "cuda" and not INTERPRET:
            raise RuntimeError("triton kernels need CUDA tensors unless TRITON_INTERPRET=1 was set before "
                               f"{__name__} was imported (got {tensors[0].device})")
        if INTERPRETER_BROKEN:
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot "
                               "run our kernels: set TRITON_INTERPRET=1 before anything imports triton")
        D = tensors[0].shape[-1]
        if D > 256:
            raise ValueError(f"head_dim {D} > 256 is not supported")
        # tl.dot needs every tile side >= 16: pad head_dim 8 up to 16 (masked columns are zeros).
        return max(16, triton.next_power_of_2(D))

    def prefill(self, q, k, v, cu_seqlens, max_seqlen, scale):
        N, H, D = q.shape
        KVH = k.shape[1]
        assert H % KVH == 0, f"{H} query heads cannot share {KVH} kv heads evenly"
        BLOCK_D = self._check(q, k, v)
        BLOCK_M, BLOCK_N, num_warps, num_stages = _prefill_config(BLOCK_D, q.dtype)
        BLOCK_M, BLOCK_N = self.block_m or BLOCK_M, self.block_n or BLOCK_N
        out = _empty_out(q)  # [N, H, D]
        B = cu_seqlens.numel() - 1
        if N == 0 or B == 0:
            return out.to(q.dtype)
        upcast, precision = _launch_flags(q.dtype)
        grid = (triton.cdiv(max_seqlen, BLOCK_M), H, B)  # query blocks x heads x requests
        _prefill_kernel[grid](
            q, k, v, out, cu_seqlens, scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            GROUP=H // KVH, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            UPCAST=upcast, DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
        )
        return out.to(q.dtype)  # no-op on a GPU

    def decode(self, q, k_cache, v_cache, slot_ids, seq_lens, scale):
        B, H, D = q.shape
        KVH = k_cache.shape[2]
        assert H % KVH == 0, f"{H} query heads cannot share {KVH} kv heads evenly"
        BLOCK_D = self._check(q, k_cache, v_cache)
        BLOCK_N = self.decode_block_n or (64 if BLOCK_D <= 128 else 32)
        out = _empty_out(q)  # [B, H, D]
        if B == 0:
            return out.to(q.dtype)
        # k_cache is one layer's view of an [L, num_slots, max_len, KVH, D] tensor: passing its strides lets the
        # kernel read it in place (no .contiguous() copy of the whole cache every layer, every step).
        _decode_kernel[(B, H)](
            q, k_cache, v_cache, out, slot_ids, seq_lens, scale * LOG2E,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
            GROUP=H // KVH, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        )
        return out.to(q.dtype)  # no-op on a GPU
