"""The attention backend interface: two operations, named after the flash-attention functions they
mirror.

- prefill (`flash_attn_varlen_func`-style): the prompts of a batch are packed one after another into
  [num_tokens, heads, head_dim]; `cu_seqlens` ([B+1], int32) marks where each request starts. Causal
  attention within each request, never across requests.
- decode (`flash_attn_with_kvcache`-style): one new query per request, [B, heads, head_dim], against
  that request's cache row `k_cache[slot_ids[b], :seq_lens[b]]`.

Storing the new K/V into the cache is the same for every backend, so it lives here, in `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Everything one forward pass of the model needs besides the weights (SGLang's name for it)."""

    phase: str  # "prefill" or "decode"
    input_ids: torch.Tensor  # [N] packed tokens of all requests
    positions: torch.Tensor  # [N] each token's position in its own request
    # [N] the KV cache row (request slot) each token's K/V is written to
    token_slot_ids: torch.Tensor
    slot_ids: torch.Tensor  # [B] int32 the cache row of each request
    seq_lens: torch.Tensor  # [B] int32 tokens of each request in the cache after this pass
    # [B+1] int32 prefix sums of new tokens per request: request b is [cu[b], cu[b+1])
    cu_seqlens: torch.Tensor
    max_seqlen: int  # longest new-token run (prefill) — kernels size their grids with it
    last_token_indices: torch.Tensor  # [B] where each request's last token sits in the packed N
    kv_cache: "BatchKVCache"  # noqa: F821 (kv_cache.py)
    attn_backend: "AttentionBackend"

    @property
    def batch_size(self) -> int:
        return self.slot_ids.shape[0]


class AttentionBackend:
    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, KVH, D] (this pass's tokens) -> [N, H, D]."""
        fb.kv_cache.store(layer_id, k, v, fb.token_slot_ids, fb.positions)
        scale = q.shape[-1] ** -0.5
        if fb.phase == "prefill":
            # Stage 2 prefills start from an empty cache, so the new K/V are all the keys there are.
            return self.prefill(q, k, v, fb.cu_seqlens, fb.max_seqlen, scale)
        k_cache, v_cache = fb.kv_cache.layer(layer_id)  # [num_slots, max_len, KVH, D] each
        return self.decode(q, k_cache, v_cache, fb.slot_ids, fb.seq_lens, scale)

    def prefill(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, slot_ids, seq_lens, scale: float) -> torch.Tensor:
        raise NotImplementedError
