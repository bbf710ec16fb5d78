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

import ctypes
import sys

import torch


class PagedKVPool:
    """The K/V memory, in pages. Knows nothing of requests: the cache manager hands pages out."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = zeros_in_huge_pages(shape, dtype, device)  # [L, num_pages, page_size, KVH, D]
        self.v = zeros_in_huge_pages(shape, dtype, device)
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
        # inside graph.py's compiled decode, the same store as an operator (below)
        store = store_kv if torch.compiler.is_compiling() else _store_kv
        store(self.k[layer_id], self.v[layer_id], k, v, out_cache_loc)


# The store as an operator that declares it writes k_cache and v_cache in place (`Tensor(a!)`), for
# torch.compile. Traced as its plain index assignment (`_store_kv`), into a view of a pool the
# graph takes as an input, it is made functional: the generated code copied the layer's whole pool
# into a new buffer (18 MB each for K and V, SmolLM2 here), wrote the new K/V there, and let
# attention read the copy, every layer of every step.
def _store_kv(k_cache, v_cache, k, v, out_cache_loc):
    """k_cache, v_cache [num_pages, page_size, KVH, D] of one layer; k, v [N, KVH, D]."""
    k_cache.view(-1, *k.shape[1:])[out_cache_loc] = k
    v_cache.view(-1, *v.shape[1:])[out_cache_loc] = v


_PACKAGE = __name__.split(".")[0]  # each stage package registers its own operator
_LIB = torch.library.Library(_PACKAGE, "FRAGMENT")
_LIB.define("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
            "Tensor out_cache_loc) -> ()")
_LIB.impl("store_kv", _store_kv, "CompositeExplicitAutograd")
torch.library.register_fake(f"{_PACKAGE}::store_kv", lib=_LIB)(lambda *args: None)
store_kv = getattr(torch.ops, _PACKAGE).store_kv


def zeros_in_huge_pages(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, but on a Linux CPU the memory is first advised to be backed by 2 MB pages
    (madvise MADV_HUGEPAGE, before anything touches it). Decode reads every request's pages, which
    lie anywhere in the pool: with 4 KB pages each of them costs address-translation misses, and
    2 MB pages cut those (measured: the cpu backend's decode attention ~7% faster). Elsewhere, or
    where the kernel declines, it is plain zeros."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu":
        advise_huge_pages(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
    return t.zero_()


HUGE_PAGE = 1 << 21
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's values; MADV_COLLAPSE since Linux 6.1


def advise_huge_pages(start: int, end: int, collapse: bool = False) -> None:
    """Ask Linux to back the whole 2 MB pages inside the addresses [start, end) with 2 MB pages:
    MADV_HUGEPAGE for memory nothing has touched yet; with `collapse`, also MADV_COLLAPSE, which
    moves memory already written into 2 MB pages now (a copy). Where the kernel declines (older
    than 6.1, or huge pages turned off), the memory stays as it was. A no-op off Linux."""
    start = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = end // HUGE_PAGE * HUGE_PAGE
    if sys.platform != "linux" or end <= start:
        return
    libc = ctypes.CDLL(None)
    for advice in (MADV_HUGEPAGE, MADV_COLLAPSE) if collapse else (MADV_HUGEPAGE,):
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


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
