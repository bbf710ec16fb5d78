"""An adapter for the flash-attention 2 library (`pip install flash-attn`, CUDA only, fp16/bf16
only), paged.

flash-attn 2 reads a paged KV cache itself when given a `block_table` ([B, max_pages] int32: request
b's page ids, in order), which is our page_table indexed by req_rows. Each operation is still one
call:

- prefill (extend) -> `flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, causal=True, block_table=...)`. With a block_table, k/v are the whole
  pool ([num_pages, page_size, KVH, D]) and cu_seqlens_k holds prefix sums of the *total* key counts
  (seq_lens), not of the new tokens. Its causal mask is aligned to the bottom-right corner: with T
  queries and S keys, query i sees keys 0 .. S - T + i = prefix_len + i, exactly our extend rule.
  (Paged varlen arrived in 2024, Dao-AILab/flash-attention PR #831; older versions have no
  block_table argument, and we say so.)
- decode -> `flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seq_lens, block_table=...)`,
  k=None, v=None: the new token's K/V is already stored and counted in seq_lens (see stage 2's
  adapter for that trap).

The catch: flash-attn 2 checks `page_block_size % 256 == 0` ("Paged KV cache block size must be
divisible by 256") in both calls. Our small pages (1, 16) are refused here with that reason; use
page_size 256 (or a multiple) with this backend, or the triton/torch backends. (flash-attn 3 for
Hopper, and vLLM's fork of flash-attn 2, accept small pages; they are other packages.) Untested on
this project's CPU machines: keep every line checkable by reading.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .base import AttentionBackend, ForwardBatch

# flash-attn 2's TORCH_CHECK in varlen_fwd and fwd_kvcache (a limit of its tiling)
FLASH_ATTN_PAGE_MULTIPLE = 256


class FlashAttnUnavailableError(ImportError):
    pass


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self):
        # Imported here, not at the top: importing this module must work on machines without
        # flash_attn.
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        # also a flash_attn built against another torch ("undefined symbol ...")
        except ImportError as e:
            raise FlashAttnUnavailableError(
                f"flash_attn is not importable ({e}); its pip wheels need CUDA "
                "(pip install flash-attn --no-build-isolation on a CUDA machine). "
                "Use --attention-backend triton or torch instead.") from e
        if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
            raise FlashAttnUnavailableError(
                "this flash_attn's flash_attn_varlen_func has no block_table argument (paged KV), "
                "which the paged "
                "extend needs: upgrade flash-attn, or use --attention-backend triton or torch"
            )
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @staticmethod
    def check_inputs(q: torch.Tensor, k_cache: torch.Tensor) -> None:
        """Refuse what flash-attn 2 cannot do, with the reason (a static method: testable without
        flash_attn)."""
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"flash_attn computes in float16/bfloat16 only, got {q.dtype}: run with "
                "--dtype bfloat16, or use the triton or torch backend for float32")
        page_size = k_cache.shape[1]
        if page_size % FLASH_ATTN_PAGE_MULTIPLE != 0:
            raise ValueError(
                f"flash_attn 2 reads a paged KV cache only when page_size is a multiple of "
                f"{FLASH_ATTN_PAGE_MULTIPLE} (got page_size {page_size}): use page_size "
                f"{FLASH_ATTN_PAGE_MULTIPLE} with this backend, or the triton or torch backend")

    @staticmethod
    def _block_table(fb: ForwardBatch) -> torch.Tensor:
        # [B, max_pages] int32, contiguous (advanced indexing copies): request b's pages in position
        # order.
        return fb.page_table[fb.req_rows.long()]

    def prefill(self, q, k, v, k_cache, v_cache, fb: ForwardBatch, scale):
        # q: [N, H, D] new tokens; k_cache, v_cache: [num_pages, page_size, KVH, D]. k, v (the new
        # tokens' K/V) are not passed: they are in the pool already, and flash-attn reads prefix and
        # new keys alike through the pages.
        self.check_inputs(q, k_cache)
        # [B+1]: 0, s0, s0+s1, ...
        cu_seqlens_k = F.pad(fb.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(q, k_cache, v_cache, fb.cu_seqlens.to(torch.int32), cu_seqlens_k,
                            fb.max_seqlen, fb.max_seq_len, softmax_scale=scale, causal=True,
                            block_table=self._block_table(fb))  # [N, H, D]

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        # q: [B, H, D] -> with_kvcache wants [B, seqlen_q=1, H, D]. causal=True is a no-op for one
        # query.
        self.check_inputs(q, k_cache)
        out = self._with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, k=None, v=None, cache_seqlens=fb.seq_lens.to(
                torch.int32), block_table=self._block_table(fb), softmax_scale=scale, causal=True)
        return out.squeeze(1)  # [B, H, D]
