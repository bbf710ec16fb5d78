"""A KV cache for a batch: one preallocated row ("slot") per request, each with its own length.

    k[layer]  : [num_slots, max_len, KVH, D]     request r owns row slot_r; its token at position p
                                                 is at [slot_r, p]

Stage 1's cache belonged to one request. Here every request of a batch gets a slot when it starts
and gives it back when its batch ends; lengths differ per request, so attention is told each
request's length (`seq_lens`). The catch, fixed in stage 4: every slot is as long as the longest
request may become, so short requests waste most of their row. (`flash_attn_with_kvcache` reads
exactly this layout, with `cache_batch_idx` = slot ids.)
"""

from __future__ import annotations

import torch


class BatchKVCache:

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_slots, max_len, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.free_slots = list(range(num_slots))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def alloc_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.num_slots} KV cache slots are in use")
        return self.free_slots.pop(0)

    def free_slot(self, slot: int) -> None:
        assert slot not in self.free_slots, f"slot {slot} freed twice"
        self.free_slots.append(slot)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]  # [num_slots, max_len, KVH, D] views

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, token_slot_ids: torch.Tensor,
              positions: torch.Tensor) -> None:
        """Write this pass's K/V ([N, KVH, D]) of every token at (its request's slot, its
        position)."""
        self.k[layer_id, token_slot_ids, positions] = k
        self.v[layer_id, token_slot_ids, positions] = v
