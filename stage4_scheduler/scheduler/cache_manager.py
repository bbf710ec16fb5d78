"""The cache manager: hands out KV pages and page-table rows, takes them back, and can prove it lost
none.

It owns the *bookkeeping* (free list, each request's pages) on the host; the engine owns the memory.
"""

from __future__ import annotations

from ..core import Req
from ..kv_cache import PagedKVPool, PageTable


class CacheManager:
    def __init__(self, pool: PagedKVPool, page_table: PageTable):
        self.pool, self.page_table, self.page_size = pool, page_table, pool.page_size
        # a stack: pop() gives page 0 first
        self.free_pages: list[int] = list(range(pool.num_pages - 1, -1, -1))
        self.req_pages: dict[int, list[int]] = {}  # rid -> its pages, in position order

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.pool.num_pages - len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)  # ceil

    def pages_missing(self, req: Req, num_tokens: int) -> int:
        """Pages the request still needs so that it can hold num_tokens tokens."""
        return max(0, self.pages_for(num_tokens) - len(self.req_pages.get(req.rid, [])))

    def can_run(self) -> bool:
        return bool(self.page_table.free_rows)

    def acquire_row(self, req: Req) -> None:
        row = self.page_table.alloc_row()
        assert row is not None, "no free page-table row: the scheduler must check can_run() first"
        req.table_idx = row
        self.req_pages[req.rid] = []

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Give the request enough pages to hold num_tokens tokens; all or nothing. False: not
        enough free pages."""
        missing = self.pages_missing(req, num_tokens)
        if missing > len(self.free_pages):
            return False
        pages = self.req_pages[req.rid]
        new = [self.free_pages.pop() for _ in range(missing)]
        self.page_table.write(req.table_idx, len(pages), new)
        pages.extend(new)
        return True

    def slots(self, req: Req, start: int, end: int) -> list[int]:
        """Pool slots (page * page_size + offset) of the request's positions start .. end-1: where
        K/V go."""
        pages, ps = self.req_pages[req.rid], self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def release(self, req: Req) -> None:
        """Give back every page and the page-table row (request finished, aborted or preempted)."""
        self.free_pages.extend(reversed(self.req_pages.pop(req.rid)))
        self.page_table.free_row(req.table_idx)
        req.table_idx = -1

    def check_integrity(self, running: list[Req] = ()) -> None:
        """free + used == total, no page owned twice or both owned and free, rows consistent with
        requests."""
        owned = [p for pages in self.req_pages.values() for p in pages]
        assert len(set(owned)) == len(owned), "a KV page is owned by two requests"
        assert not set(owned) & set(self.free_pages), "a KV page is both free and owned"
        assert len(set(self.free_pages)) == len(
            self.free_pages), "a KV page is on the free list twice"
        assert (
            len(owned) + len(self.free_pages) == self.pool.num_pages
        ), (
            f"pages leaked: {len(owned)} owned + {len(self.free_pages)} free != "
            f"{self.pool.num_pages}"
        )
        used_rows = self.page_table.max_rows - len(self.page_table.free_rows)
        assert used_rows == len(
            self.req_pages), f"{used_rows} page-table rows used by {len(self.req_pages)} requests"
        for req in running:
            assert (
                req.rid in self.req_pages and req.table_idx >= 0
            ), f"running request {req.rid} holds no pages"
            # Cached tokens must sit in owned pages; the next token gets its page when its batch is
            # built.
            assert len(self.req_pages[
                req.rid]) * self.page_size >= req.cached_len, f"request {req.rid} overflows"
