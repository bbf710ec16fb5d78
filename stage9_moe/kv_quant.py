"""A quantized KV cache (`kv_cache_dtype`, SGLang's option): K and V stored in one byte per value.

Every decode step reads every cached key and value of every running request, so the pool's bytes per
token decide both how many tokens fit and how much memory traffic a step costs. Stored in 8 bits
instead of 16 or 32, the same memory holds ~2x (bfloat16) or ~4x (float32) the tokens.

Each token's K (and V) of one KV head, D values, gets its own scale, a float32 absmax / QMAX, so
that the largest value of that row lands on the format's largest value: per token and head, because
heads differ much in size, and because a row quantized when written never needs requantizing when
later tokens arrive.

    int8      q = round(x / scale) in [-127, 127]         scale = absmax / 127   (uniform steps)
    fp8_e4m3  q = float8_e4m3fn(x / scale) in [-448, 448]  scale = absmax / 448   (3 mantissa bits:
                                                                                   relative steps)
    read:     x ~= q * scale

The pool then holds, per layer, int8 / float8 tensors shaped like the float ones, plus scale tensors
[num_pages, page_size, KVH, 1] indexed like the pages (kv_cache.py). The scales cost 4 bytes per D
values: bytes per token 2 * layers * KVH * (D + 4), against D * 2 (bfloat16) or D * 4 (float32).
"""

from __future__ import annotations

import torch

# "auto": the model's dtype (no quantization)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest value each format holds
SCALE_DTYPE = torch.float32


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")


def is_quantized(kv_cache_dtype: str) -> bool:
    check_kv_cache_dtype(kv_cache_dtype)
    return kv_cache_dtype != "auto"


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, KVH, D] float -> (q [N, KVH, D] int8 / float8_e4m3fn, scale [N, KVH, 1] float32)."""
    qmax = QMAX[kv_cache_dtype]
    absmax = x.abs().amax(dim=-1, keepdim=True).to(SCALE_DTYPE)  # [N, KVH, 1]
    # an all-zero row keeps a positive scale: 0 / scale = 0, never 0 / 0
    scale = absmax.clamp(min=1e-12) / qmax
    y = x.to(SCALE_DTYPE) / scale  # [N, KVH, D] in [-qmax, qmax]
    if kv_cache_dtype == "int8":
        q = y.round().clamp(-qmax, qmax).to(torch.int8)
    else:  # the cast rounds to the nearest float8 value; the clamp keeps rounding error off NaN
        q = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] int8 / float8, scale [..., 1] -> q * scale [..., D] in dtype."""
    return (q.to(SCALE_DTYPE) * scale).to(dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """The pool's bytes for one token: K and V of every layer and KV head, plus their scales."""
    if not is_quantized(kv_cache_dtype):
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element_bytes
    scale_bytes = torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * num_layers * num_kv_heads * (head_dim * 1 + scale_bytes)
