"""A paged KV cache: one preallocated pool of fixed-size pages shared by all requests, and a page
table.

    k_pool[layer] : [num_pages, page_size, KVH, D]      all the memory there is, allocated once at
                                                        start-up
    page_table    : [max_running_reqs, max_pages_per_req]  row r lists the pages of the request in
                                                           row r

A request's token at position p lives in page page_table[row, p // page_size], at offset p %
page_size. Pages come from a free list and return to it when the request finishes (or is preempted),
so memory is spent on tokens that exist, not on the longest a request might become (stage 2's
slots). Attention reads keys through the page table.
"""

from __future__ import annotations

import torch


class PagedKVPool:
    """The K/V memory, in pages. Knows nothing of requests: the cache manager hands pages out."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_pages, page_size, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(
            (), dtype=dtype).element_size()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]  # [num_pages, page_size, KVH, D] views

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
              out_cache_loc: torch.Tensor) -> None:
        """Write this pass's K/V ([N, KVH, D]) at their token slots (page * page_size + offset),
        [N]."""
        self.k[layer_id].view(-1, *k.shape[1:])[out_cache_loc] = k
        self.v[layer_id].view(-1, *v.shape[1:])[out_cache_loc] = v


class PageTable:
    """Request rows -> page ids. Kept on the device because attention kernels read it every
    layer."""

    def __init__(self, max_running_reqs: int, max_pages_per_req: int, device: torch.device | str):
        self.table = torch.zeros(max_running_reqs, max_pages_per_req, dtype=torch.int32,
                                 device=device)
        self.free_rows = list(range(max_running_reqs))

    @property
    def max_rows(self) -> int:
        return self.table.shape[0]

    def alloc_row(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free_row(self, row: int) -> None:
        assert row not in self.free_rows, f"page-table row {row} freed twice"
        self.free_rows.append(row)

    def write(self, row: int, first_page_index: int, pages: list[int]) -> None:
        if pages:
            self.table[row, first_page_index : first_page_index + len(pages)] = torch.tensor(
                pages, dtype=torch.int32, device=self.table.device)
