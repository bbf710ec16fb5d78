"""The triton attention backend: `TritonBackend` checks its inputs, picks each launch's tile sizes
and grid, and runs the kernels of triton_kernels.py (read that module first: what the kernels
compute, how decode is split, and how they run on a CPU).
"""

from __future__ import annotations

import torch

from .base import AttentionBackend, ForwardBatch
# triton itself comes from triton_kernels, which sets TRITON_INTERPRET before importing it
from .triton_kernels import (
    INTERPRET,
    INTERPRETER_BROKEN,
    LOG2E,
    _decode_combine_kernel,
    _decode_partial_kernel,
    _extend_kernel,
    triton,
)


def _launch_flags(dtype: torch.dtype) -> tuple[bool, str]:
    # As in stage 2: UPCAST under the interpreter only (NumPy has no bfloat16); "ieee" keeps fp32
    # exact on GPUs.
    return INTERPRET, "ieee" if dtype == torch.float32 else "tf32"


def _extend_config(BLOCK_D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): stage 2's prefill tiles (picked from ptxas
    register counts, not benchmarked). Reading through the page table adds one small [BLOCK_N] int
    load per step. Retune on a GPU."""
    if INTERPRET:
        # the interpreter runs each program as a Python loop: fewer, bigger tiles are faster
        return 64, 64, 4, 1
    if dtype == torch.float32:
        return (32, 32, 4, 2) if BLOCK_D <= 64 else (16, 32, 4, 2)
    if BLOCK_D <= 64:
        return 64, 64, 4, 2
    if BLOCK_D <= 128:
        return 64, 64, 8, 2
    return 64, 32, 8, 2


# How many programs share one request's keys in decode (SGLang: --triton-attention-num-kv-splits,
# default 8). Fixed per backend, not computed from seq_lens: the grid must not depend on device data
# (stage 5 records decode in a CUDA graph). On a GPU 8, untuned until measured (`python -m
# common.bench_attention` times it against one program per query head): more splits fill more SMs at
# small batch and long context; each split costs a partial row of scratch. Under the interpreter,
# where every program is a Python loop, 2: fewer programs run faster, and 2 still sends every engine
# run through the split-and-combine path.
DEFAULT_NUM_KV_SPLITS = 2 if INTERPRET else 8


def _decode_config(BLOCK_D: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split decode kernel. Each step holds a [16, BLOCK_D]
    query tile, two [BLOCK_N, BLOCK_D] K/V tiles and the fp32 accumulator in registers. Compiled for
    sm_80 and sm_90 without a GPU: no spills; at head_dim 128, 32 keys per step take ~170 registers
    a thread where 64 hit ptxas's 255 cap (SGLang's grouped decode kernel also steps 32 keys with 4
    warps). Untuned until measured (`common/bench_attention.py`)."""
    if INTERPRET:
        # the interpreter runs each program as a Python loop: fewer, bigger steps are faster
        return 64, 4, 1
    return (64 if BLOCK_D <= 64 else 32), 4, 2


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    # Under the interpreter the kernels write fp32 and torch rounds to bf16/fp16 (the interpreter
    # truncates).
    return torch.empty(q.shape, dtype=torch.float32 if INTERPRET else q.dtype, device=q.device)


class TritonBackend(AttentionBackend):
    name = "triton"
    reads_quantized_kv = True  # stage 9: the kernels dequantize as they load (KV_QUANT)

    def __init__(self, block_m: int | None = None, block_n: int | None = None,
                 decode_block_n: int | None = None, num_kv_splits: int = DEFAULT_NUM_KV_SPLITS):
        # None = a default picked per head_dim at launch. Tests pass small blocks to exercise the
        # multi-block paths.
        if not isinstance(num_kv_splits, int) or num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be an integer >= 1, got {num_kv_splits!r}")
        self.block_m, self.block_n, self.decode_block_n = block_m, block_n, decode_block_n
        self.num_kv_splits = num_kv_splits

    @staticmethod
    def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fb: ForwardBatch,
               index_fields: tuple[str, ...]) -> int:
        if q.device.type != "cuda" and not INTERPRET:
            raise RuntimeError(
                "triton kernels need CUDA tensors unless TRITON_INTERPRET=1 was set before "
                f"{__name__} was imported (got {q.device})")
        if INTERPRETER_BROKEN:
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot "
                "run our kernels: set TRITON_INTERPRET=1 before anything imports triton")
        if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
            raise ValueError(
                "k_cache/v_cache must be [num_pages, page_size, KVH, D], got "
                f"{tuple(k_cache.shape)} "
                f"and {tuple(v_cache.shape)}"
            )
        for name in index_fields:
            t = getattr(fb, name)
            # the kernels load them as int32: an int64 tensor would be misread
            if t.dtype != torch.int32:
                raise TypeError(f"ForwardBatch.{name} must be int32, got {t.dtype}")
        D = q.shape[-1]
        if D > 256:
            raise ValueError(f"head_dim {D} > 256 is not supported")
        return max(16, triton.next_power_of_2(D))  # tl.dot needs every tile side >= 16

    def prefill_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch, scale):
        return self.prefill(q, None, None, k_cache, v_cache, fb, scale, kv_scales)  # [N, H, D]

    def decode_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch, scale):
        return self.decode(q, k_cache, v_cache, fb, scale, kv_scales)  # [B, H, D]

    @staticmethod
    def _scale_args(k_cache: torch.Tensor, kv_scales) -> tuple:
        """The kernels' K_scale, V_scale and their (page, slot, head) strides: a quantized pool's
        [num_pages, page_size, KVH, 1] scales, or placeholders a float pool's launch never reads."""
        if kv_scales is None:
            return (k_cache, k_cache, 0, 0, 0, 0, 0, 0)
        k_scale, v_scale = kv_scales
        return (k_scale, v_scale, *k_scale.stride()[:3], *v_scale.stride()[:3])

    def prefill(self, q, k, v, k_cache, v_cache, fb: ForwardBatch, scale, kv_scales=None):
        # q: [N, H, D] new tokens. k, v (the same tokens' K/V) are not read: the kernel finds them
        # in the pool.
        N, H, D = q.shape
        page_size, KVH = k_cache.shape[1], k_cache.shape[2]
        assert H % KVH == 0, f"{H} query heads cannot share {KVH} kv heads evenly"
        BLOCK_D = self._check(q, k_cache, v_cache, fb,
                              ("cu_seqlens", "prefix_lens", "req_rows", "page_table"))
        BLOCK_M, BLOCK_N, num_warps, num_stages = _extend_config(BLOCK_D, q.dtype)
        BLOCK_M, BLOCK_N = self.block_m or BLOCK_M, self.block_n or BLOCK_N
        out = _empty_out(q)  # [N, H, D]
        B = fb.cu_seqlens.numel() - 1
        if N == 0 or B == 0:
            return out.to(q.dtype)
        upcast, precision = _launch_flags(q.dtype)
        grid = (triton.cdiv(fb.max_seqlen, BLOCK_M), H, B)  # new-token blocks x heads x requests
        _extend_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            fb.cu_seqlens,
            fb.prefix_lens,
            fb.req_rows,
            fb.page_table,
            scale * LOG2E,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *out.stride(),
            *fb.page_table.stride(),
            *self._scale_args(k_cache, kv_scales),
            PAGE_SIZE=page_size,
            GROUP=H // KVH,
            HEAD_DIM=D,
            BLOCK_D=BLOCK_D,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            KV_QUANT=kv_scales is not None,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        return out.to(q.dtype)  # no-op on a GPU

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale, kv_scales=None):
        B, H, D = q.shape
        page_size, KVH = k_cache.shape[1], k_cache.shape[2]
        assert H % KVH == 0, f"{H} query heads cannot share {KVH} kv heads evenly"
        BLOCK_D = self._check(q, k_cache, v_cache, fb, ("req_rows", "seq_lens", "page_table"))
        BLOCK_N, num_warps, num_stages = _decode_config(BLOCK_D)
        BLOCK_N = self.decode_block_n or BLOCK_N
        GROUP, S = H // KVH, self.num_kv_splits
        out = _empty_out(q)  # [B, H, D]
        if B == 0:
            return out.to(q.dtype)
        upcast, precision = _launch_flags(q.dtype)
        # the splits' partials, as in stage 2
        part_o = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        # k_cache is one layer's view of the [L, num_pages, page_size, KVH, D] pool: its strides let
        # the kernel read it in place, as in stage 2.
        _decode_partial_kernel[(B, KVH, S)](
            q,
            k_cache,
            v_cache,
            part_o,
            part_lse,
            fb.req_rows,
            fb.seq_lens,
            fb.page_table,
            scale * LOG2E,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *part_o.stride(),
            *part_lse.stride(),
            *fb.page_table.stride(),
            *self._scale_args(k_cache, kv_scales),
            PAGE_SIZE=page_size,
            GROUP=GROUP,
            HEAD_DIM=D,
            BLOCK_D=BLOCK_D,
            BLOCK_H=max(16, triton.next_power_of_2(GROUP)),
            BLOCK_N=BLOCK_N,
            NUM_KV_SPLITS=S,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            KV_QUANT=kv_scales is not None,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        _decode_combine_kernel[(B, H)](
            part_o, part_lse, out, *part_o.stride(), *part_lse.stride(), *out.stride(),
            HEAD_DIM=D, BLOCK_D=BLOCK_D, NUM_KV_SPLITS=S, BLOCK_S=triton.next_power_of_2(S),
        )
        return out.to(q.dtype)  # no-op on a GPU
