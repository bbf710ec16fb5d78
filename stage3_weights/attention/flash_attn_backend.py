"""An adapter for the flash-attention 2 library (`pip install flash-attn`, CUDA only, fp16/bf16
only).

Our interface was modelled on it, so each operation is one call:
- prefill -> `flash_attn_varlen_func`: packed prompts + cu_seqlens; queries and keys are the same
  tokens (stage 2 prefills start from an empty cache), so cu_seqlens_q == cu_seqlens_k and
  max_seqlen_q == max_seqlen_k.
- decode -> `flash_attn_with_kvcache` with `cache_batch_idx=slot_ids`: request b reads cache row
  slot_ids[b].

One trap in with_kvcache: it can also *append* this step's K/V (its `k`, `v` arguments), and then
`cache_seqlens` means the length BEFORE the append. We don't use that: `AttentionBackend.forward`
has already stored the new token's K/V and `seq_lens` counts it. So we pass k=None, v=None and
cache_seqlens=seq_lens: "attend to the first seq_lens[b] rows, which already include the new token".
(Passing k/v too would write the token a second time, one row later.)
"""

from __future__ import annotations

import torch

from .base import AttentionBackend


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
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @staticmethod
    def _check_dtype(q: torch.Tensor) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"flash_attn computes in float16/bfloat16 only, got {q.dtype}: run with "
                "--dtype bfloat16, or use the triton or torch backend for float32")

    def prefill(self, q, k, v, cu_seqlens, max_seqlen, scale):
        # q: [N, H, D]; k, v: [N, KVH, D]; GQA is native (H must be a multiple of KVH). -> [N, H, D]
        self._check_dtype(q)
        cu = cu_seqlens.to(torch.int32)
        return self._varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale,
                            causal=True)

    def decode(self, q, k_cache, v_cache, slot_ids, seq_lens, scale):
        # q: [B, H, D] -> with_kvcache wants [B, seqlen_q=1, H, D]. k_cache: [num_slots, max_len,
        # KVH, D]; any strides as long as the last dim is contiguous, so one layer's view of the big
        # cache is fine as it is. causal=True is a no-op for one query (the mask is aligned
        # bottom-right: the last query sees every key).
        self._check_dtype(q)
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, k=None, v=None,
                                 cache_seqlens=seq_lens.to(
                                     torch.int32), cache_batch_idx=slot_ids.to(torch.int32),
                                 softmax_scale=scale, causal=True)
        return out.squeeze(1)  # [B, H, D]
