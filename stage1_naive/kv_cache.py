"""Naive KV caches for one request.

Without a cache, every decode step would recompute K and V for the whole sequence: step n costs O(n)
matmul rows, so n steps cost O(n^2) rows (and O(n^3) attention work). With a cache each step
computes K/V for one new token and only *reads* the old ones.

Two versions with the same interface, `update(layer_id, k, v) -> (k_all, v_all)`:
- GrowingKVCache: torch.cat a new tensor every step. Simple, but each step copies the whole cache
  (O(n) bytes per step, O(n^2) total) and allocates memory of a new size every time.
- StaticKVCache: allocate max_len slots once and write the new rows in place, right after the rows
  already filled (a counter, `seq_len`, says where: with one request, row p holds position p;
  gpt-fast passes the positions, `input_pos`, instead). No copies, a fixed memory footprint known up
  front: the reason every real engine preallocates, and the start of stage 2's per-request slots and
  stage 4's paged pool.
"""

from __future__ import annotations

import torch


class GrowingKVCache:
    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers  # per layer: [S, KVH, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def seq_len(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        # k, v: [T, KVH, D] -> everything so far: [S, KVH, D]
        if self.k[layer_id] is None:
            self.k[layer_id], self.v[layer_id] = k, v
        else:
            self.k[layer_id] = torch.cat([self.k[layer_id], k])  # copies all S rows: O(S) per step
            self.v[layer_id] = torch.cat([self.v[layer_id], v])
        return self.k[layer_id], self.v[layer_id]


class StaticKVCache:
    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, max_len, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._len = 0  # rows filled, shared by all layers

    @property
    def seq_len(self) -> int:
        return self._len

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        T = k.shape[0]
        start = self._len
        if start + T > self.max_len:
            raise RuntimeError(f"KV cache full: {start} + {T} > {self.max_len} slots")
        self.k[layer_id, start : start + T] = k  # write in place: no copy of the old rows
        self.v[layer_id, start : start + T] = v
        if layer_id == self.k.shape[0] - 1:
            self._len += T  # the last layer has written: the pass's tokens are now cached
        return self.k[layer_id, : start + T], self.v[layer_id, : start + T]  # views, not copies
