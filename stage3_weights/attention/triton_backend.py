"""The triton attention backend: `TritonBackend` checks its inputs, picks each launch's tile sizes
and grid, and runs the kernels of triton_kernels.py (read that module first: what the kernels
compute, how decode is split, and how they run on a CPU).
"""

from __future__ import annotations

import torch

from .base import AttentionBackend
# triton itself comes from triton_kernels, which sets TRITON_INTERPRET before importing it
from .triton_kernels import (
    INTERPRET,
    INTERPRETER_BROKEN,
    LOG2E,
    _decode_combine_kernel,
    _decode_partial_kernel,
    _prefill_kernel,
    triton,
)


def _launch_flags(dtype: torch.dtype) -> tuple[bool, str]:
    # UPCAST only under the interpreter: it emulates tl.dot with NumPy, which has no bfloat16, and
    # gets bf16 tiles wrong. On a GPU a bf16 x bf16 -> fp32 tl.dot is exactly what tensor cores do
    # best, so we keep it there. DOT_PRECISION: on GPUs tl.dot rounds fp32 inputs to tf32 (10-bit
    # mantissa) by default, ~1e-3 relative error; "ieee" keeps fp32 runs as exact as torch's own
    # fp32 attention (slower, but fp32 is for checking).
    return INTERPRET, "ieee" if dtype == torch.float32 else "tf32"


def _prefill_config(BLOCK_D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Bigger tiles reuse each loaded K/V row for more
    queries, but the fp32 accumulator [BLOCK_M, BLOCK_D] and the score tile live in registers: too
    big and they spill to slow local memory. Picked by compiling for sm_80 without a GPU and reading
    ptxas's register/spill counts (no spills, except 112-224 bytes at head_dim 256; shared memory <=
    84 KB, within consumer GPUs' ~99 KB), NOT by benchmarking: retune on a GPU if prefill speed
    matters."""
    if INTERPRET:
        # the interpreter runs each program as a Python loop: fewer, bigger tiles are faster
        return 64, 64, 4, 1
    # fp32 tiles are twice the bytes, and "ieee" dots run on CUDA cores, not tensor cores
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
    # The interpreter converts fp32 -> bf16/fp16 by truncating (round toward zero, up to 1 ulp off)
    # where GPUs and torch round to nearest. So under the interpreter the kernels write fp32 and
    # torch does the final rounding.
    return torch.empty(q.shape, dtype=torch.float32 if INTERPRET else q.dtype, device=q.device)


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None,
                 decode_block_n: int | None = None, num_kv_splits: int = DEFAULT_NUM_KV_SPLITS):
        # None = a default picked per head_dim at launch. Tests pass small blocks to exercise the
        # multi-block paths.
        if not isinstance(num_kv_splits, int) or num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be an integer >= 1, got {num_kv_splits!r}")
        self.block_m, self.block_n, self.decode_block_n = block_m, block_n, decode_block_n
        self.num_kv_splits = num_kv_splits

    @staticmethod
    def _check(*tensors: torch.Tensor) -> int:
        if tensors[0].device.type != "cuda" and not INTERPRET:
            raise RuntimeError(
                "triton kernels need CUDA tensors unless TRITON_INTERPRET=1 was set before "
                f"{__name__} was imported (got {tensors[0].device})")
        if INTERPRETER_BROKEN:
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot "
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
        BLOCK_N, num_warps, num_stages = _decode_config(BLOCK_D)
        BLOCK_N = self.decode_block_n or BLOCK_N
        GROUP, S = H // KVH, self.num_kv_splits
        out = _empty_out(q)  # [B, H, D]
        if B == 0:
            return out.to(q.dtype)
        upcast, precision = _launch_flags(q.dtype)
        # Scratch for the splits' partial answers, fp32 whatever the model dtype (they are sums, not
        # outputs).
        part_o = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        # k_cache is one layer's view of an [L, num_slots, max_len, KVH, D] tensor: passing its
        # strides lets the kernel read it in place (no .contiguous() copy of the whole cache every
        # layer, every step).
        _decode_partial_kernel[(B, KVH, S)](
            q,
            k_cache,
            v_cache,
            part_o,
            part_lse,
            slot_ids,
            seq_lens,
            scale * LOG2E,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *part_o.stride(),
            *part_lse.stride(),
            GROUP=GROUP,
            HEAD_DIM=D,
            BLOCK_D=BLOCK_D,
            BLOCK_H=max(16, triton.next_power_of_2(GROUP)),
            BLOCK_N=BLOCK_N,
            NUM_KV_SPLITS=S,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        _decode_combine_kernel[(B, H)](
            part_o, part_lse, out, *part_o.stride(), *part_lse.stride(), *out.stride(),
            HEAD_DIM=D, BLOCK_D=BLOCK_D, NUM_KV_SPLITS=S, BLOCK_S=triton.next_power_of_2(S),
        )
        return out.to(q.dtype)  # no-op on a GPU
