"""The attention backend interface: two operations, both reading keys through the page table.

- prefill (an "extend", `flash_attn_varlen_func`-style with a paged KV cache): the new tokens of a
  batch are packed into [N, heads, head_dim]; `cu_seqlens` marks where each request's new tokens
  start. Request b's new tokens sit at positions prefix_lens[b] .. seq_lens[b]-1 and attend causally
  to everything before them in its pages: a prompt prefix cached by an earlier chunk (chunked
  prefill) or, from stage 6, by another request.
- decode (`flash_attn_with_kvcache`-style with a block table): one query per request, [B, heads,
  head_dim], against the request's first seq_lens[b] cached tokens.

A request's token at position p lives at k_cache[page_table[row, p // page_size], p % page_size].
Storing the new K/V is the same for every backend, so it lives here, in `forward`. What a backend
derives from the batch's layout (the torch backend's key slots) it builds once per pass in
`init_forward_metadata`, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Everything one forward pass of the model needs besides the weights (SGLang's name for it)."""

    phase: str  # "prefill" or "decode"
    input_ids: torch.Tensor  # [N] packed new tokens of all requests
    positions: torch.Tensor  # [N] each token's position in its own request
    # [N] the pool slot (page * page_size + offset) each token's K/V is written to
    out_cache_loc: torch.Tensor
    req_rows: torch.Tensor  # [B] int32 each request's row in the page table
    prefix_lens: torch.Tensor  # [B] int32 tokens already cached before this pass
    seq_lens: torch.Tensor  # [B] int32 tokens cached after this pass
    cu_seqlens: torch.Tensor  # [B+1] int32 new tokens of request b are [cu[b], cu[b+1])
    max_seqlen: int  # most new tokens of one request (prefill)
    max_seq_len: int  # longest request after this pass (host copy: no device sync to size loops)
    prefix_lens_cpu: list[int]  # host copies, for the loops of the reference backend
    seq_lens_cpu: list[int]
    last_token_indices: torch.Tensor  # [B] where each request's last new token sits in the packed N
    # (stage 8: then the P prompt positions whose logprobs were asked): the rows that get logits
    kv_pool: "PagedKVPool"  # noqa: F821 (kv_cache.py)
    page_table: torch.Tensor  # [max_running_reqs, max_pages_per_req] int32 page ids
    attn_backend: "AttentionBackend"
    # What the backend's init_forward_metadata prepared once for every layer of this pass (None:
    # nothing).
    attn_metadata: object = None

    @property
    def batch_size(self) -> int:
        return self.req_rows.shape[0]

    @property
    def page_size(self) -> int:
        return self.kv_pool.page_size


class AttentionBackend:
    name = "base"
    # Stage 9: whether prefill_quantized / decode_quantized read an int8 / fp8 pool (kv_quant.py)
    reads_quantized_kv = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Called once per forward pass, before the first layer: work every layer would otherwise
        repeat (SGLang's name). The kernels of the other backends read the page table themselves and
        need nothing."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, KVH, D] (this pass's tokens) -> [N, H, D]."""
        fb.kv_pool.store(layer_id, k, v, fb.out_cache_loc)
        k_cache, v_cache = fb.kv_pool.layer(layer_id)  # [num_pages, page_size, KVH, D] each
        scale = q.shape[-1] ** -0.5
        if fb.kv_pool.quantized:  # int8 / fp8 values, [num_pages, page_size, KVH, 1] scales
            kv_scales = fb.kv_pool.layer_scales(layer_id)
            if fb.phase == "prefill":
                return self.prefill_quantized(q, k_cache, v_cache, kv_scales, fb, scale)
            return self.decode_quantized(q, k_cache, v_cache, kv_scales, fb, scale)
        if fb.phase == "prefill":
            return self.prefill(q, k, v, k_cache, v_cache, fb, scale)
        return self.decode(q, k_cache, v_cache, fb, scale)

    def prefill(self, q, k, v, k_cache, v_cache, fb: ForwardBatch, scale: float) -> torch.Tensor:
        """k, v are this pass's new K/V (already stored): a backend may use them when nothing was
        cached before."""
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def prefill_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch,
                          scale: float) -> torch.Tensor:
        """prefill over a quantized pool: every key, the new tokens' too, read from the pool and
        dequantized (the new K/V are not passed: each backend sees the same keys)."""
        raise NotImplementedError(f"the {self.name} attention backend does not read a quantized "
                                  "KV cache")

    def decode_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch,
                         scale: float) -> torch.Tensor:
        raise NotImplementedError(f"the {self.name} attention backend does not read a quantized "
                                  "KV cache")
