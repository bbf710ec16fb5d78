"""The cache manager: hands out KV pages and page-table rows, takes them back, and can prove it lost
none.

It owns the *bookkeeping* (free list, each request's pages) on the host; the engine owns the memory.

Stage 6: pages that finished requests computed are not freed but kept in the radix tree
(radix_cache.py), so a later request whose prompt starts the same way reuses them. Every page is now
exactly one of:

    free                 on the free list
    in the tree          cached; *protected* while a running request's prefix runs through it
                         (locked), *evictable* otherwise: freed on demand, least recently used leaf
                         first
    private              owned by one running request: the pages it is computing now

A running request's pages, in position order, are its matched prefix (tree pages, locked for it)
followed by its private pages. When it ends (finished, aborted or preempted) its full pages go into
the tree, the partial last one and any duplicate of what the tree already had are freed, and its
lock is released.
"""

from __future__ import annotations

import torch

from ..core import Req
from ..kv_cache import PagedKVPool, PageTable
from ..radix_cache import RadixCache


class CacheManager:
    def __init__(self, pool: PagedKVPool, page_table: PageTable, tree: RadixCache | None = None):
        self.pool, self.page_table, self.page_size = pool, page_table, pool.page_size
        self.tree = tree  # None: --disable-radix-cache, stage 5's behaviour
        # a stack: pop() gives page 0 first
        self.free_pages: list[int] = list(range(pool.num_pages - 1, -1, -1))
        self.req_pages: dict[int, list[int]] = {}  # rid -> its pages, in position order
        # rid -> how many of its first pages are the tree's (locked for it)
        self.req_shared: dict[int, int] = {}

    # ---------------------------------------------------------------- counting
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_evictable_pages(self) -> int:
        return self.tree.evictable_size // self.page_size if self.tree else 0

    @property
    def num_available_pages(self) -> int:
        """Free now, or freed on demand by evicting unlocked tree pages."""
        return self.num_free_pages + self.num_evictable_pages

    @property
    def num_used_pages(self) -> int:
        """Pages held by running requests (private or locked tree pages): not available to anyone
        else."""
        return self.pool.num_pages - self.num_available_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)  # ceil

    def pages_missing(self, req: Req, num_tokens: int) -> int:
        """Pages the request still needs so that it can hold num_tokens tokens."""
        return max(0, self.pages_for(num_tokens) - len(self.req_pages.get(req.rid, [])))

    def can_run(self) -> bool:
        return bool(self.page_table.free_rows)

    # ---------------------------------------------------------------- admission
    def match_prefix(self, req: Req) -> int:
        """How many leading tokens of the request the tree holds (whole pages; never all of them:
        the last token must be computed, its logits give the next one; stage 8: nor the positions
        whose logits its prompt logprobs need, Req.max_prefix_len). Records the match on the
        request, does not lock it."""
        if self.tree is None:
            req.prefix_indices, req.last_node = torch.empty(0, dtype=torch.int64), None
            return 0
        match = self.tree.match_prefix(req.all_ids[: req.max_prefix_len])
        req.prefix_indices, req.last_node = match.indices, match.last_node
        return len(match.indices)

    def lock(self, req: Req) -> None:
        if self.tree is not None:
            self.tree.inc_lock_ref(req.last_node)

    def unlock(self, req: Req) -> None:
        if self.tree is not None:
            self.tree.dec_lock_ref(req.last_node)

    def acquire_row(self, req: Req) -> None:
        """A page-table row for the request, starting with the pages of its matched (and locked)
        prefix."""
        row = self.page_table.alloc_row()
        assert row is not None, "no free page-table row: the scheduler must check can_run() first"
        req.table_idx = row
        shared = self._pages_of(req.prefix_indices)
        self.req_pages[req.rid], self.req_shared[req.rid] = shared, len(shared)
        self.page_table.write(row, 0, shared)
        req.cached_len = len(req.prefix_indices)  # those tokens' K/V are already in the pool

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Give the request enough pages to hold num_tokens tokens, evicting unlocked tree pages if
        the free list is short; all or nothing. False: not enough pages even then."""
        missing = self.pages_missing(req, num_tokens)
        if missing > self.num_available_pages:
            return False
        self._evict_for(missing)
        pages = self.req_pages[req.rid]
        new = [self.free_pages.pop() for _ in range(missing)]
        self.page_table.write(req.table_idx, len(pages), new)
        pages.extend(new)
        return True

    def trim(self, req: Req, num_tokens: int) -> None:
        """Speculative decoding: the pages past num_tokens held only rejected drafts; free them."""
        pages = self.req_pages[req.rid]
        keep = max(self.pages_for(num_tokens), self.req_shared[req.rid])
        self.free_pages.extend(reversed(pages[keep:]))
        del pages[keep:]

    def slots(self, req: Req, start: int, end: int) -> list[int]:
        """Pool slots (page * page_size + offset) of the request's positions start .. end-1: where
        K/V go."""
        pages, ps = self.req_pages[req.rid], self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    # ---------------------------------------------------------------- into the tree, and out
    def cache_unfinished(self, req: Req) -> None:
        """The request's prompt, or a chunk of it, was computed (SGLang's cache_unfinished_req): put
        its full pages in the tree now, so that a concurrent request with the same prefix need not
        compute it again, and move the request's lock down to the new end of its cached prefix."""
        if self.tree is None:
            return
        num_full = req.cached_len // self.page_size
        old_node = req.last_node
        self._insert(req, num_full)
        match = self.tree.match_prefix(req.all_ids[: num_full * self.page_size])
        assert len(match.indices) == num_full * self.page_size, "the pages just inserted must match"
        req.prefix_indices, req.last_node = match.indices, match.last_node
        self.tree.inc_lock_ref(req.last_node)
        self.tree.dec_lock_ref(old_node)
        self.req_shared[req.rid] = num_full

    def release(self, req: Req, cache_pages: bool = True) -> None:
        """The request ended (finished, aborted or preempted): its computed full pages go into the
        tree, the rest of its pages back to the free list, its lock and its page-table row are
        released. cache_pages False (a request that failed): only the tree's own pages stay there,
        every private page is freed."""
        pages, ps = self.req_pages[req.rid], self.page_size
        # pages whose every token has its K/V
        num_full = req.cached_len // ps if self.tree is not None else 0
        if not cache_pages:
            num_full = self.req_shared[req.rid]  # already the tree's: nothing to insert
        self._insert(req, num_full)
        # the partial last page and any unused one
        self.free_pages.extend(reversed(pages[num_full:]))
        self.unlock(req)
        del self.req_pages[req.rid], self.req_shared[req.rid]
        self.page_table.free_row(req.table_idx)
        req.table_idx, req.last_node = -1, None

    def _insert(self, req: Req, num_full: int) -> None:
        """Insert the request's first num_full pages. Pages the tree already had (another request
        computed the same tokens meanwhile) are duplicates: the request's page-table row is pointed
        at the tree's pages first (a row must never name a freed page), then the duplicates are
        freed."""
        if self.tree is None or num_full == 0:
            return
        pages, ps, shared = self.req_pages[req.rid], self.page_size, self.req_shared[req.rid]
        ids = req.all_ids[: num_full * ps]
        # a copy, never a view
        slots = torch.tensor(self.slots(req, 0, num_full * ps), dtype=torch.int64)
        present = self.tree.insert(ids, slots) // ps  # pages the tree had before this insert
        if present > shared:
            tree_pages = self._pages_of(self.tree.match_prefix(ids[: present * ps]).indices)
            duplicates = pages[shared:present]
            pages[shared:present] = tree_pages[shared:present]
            self.page_table.write(req.table_idx, shared, tree_pages[shared:present])
            self.free_pages.extend(reversed(duplicates))
        self.req_shared[req.rid] = num_full  # from now on these pages are the tree's

    def _evict_for(self, num_pages: int) -> None:
        short = num_pages - len(self.free_pages)
        if short > 0:
            freed = self.tree.evict(short * self.page_size)
            self.free_pages.extend(reversed(self._pages_of(freed)))

    def flush(self) -> None:
        """Evict every unlocked tree page (SGLang's flush_cache)."""
        if self.tree is not None:
            self._evict_for(len(self.free_pages) + self.num_evictable_pages)

    def _pages_of(self, slots: torch.Tensor) -> list[int]:
        """Slot indices of whole pages -> page ids (one per page_size slots)."""
        return (slots[:: self.page_size] // self.page_size).tolist()

    # ---------------------------------------------------------------- proof
    def check_integrity(self, running: list[Req] = (), holders: list[Req] = ()) -> None:
        """Every page is exactly one of free / in the tree / private to one request; the tree's own
        invariants hold; each holder's row starts with its locked tree pages; every lock is held by
        exactly the requests whose prefix runs through it. `holders`: every request that holds pages
        (running, chunked, deferred)."""
        private = [p for rid, pages in self.req_pages.items() for p in pages[self.req_shared[rid]:]]
        tree_pages: list[int] = []
        if self.tree is not None:
            self.tree.check_integrity()
            for node in self.tree.iter_nodes():
                tree_pages += self._pages_of(node.value)
        everything = private + tree_pages + self.free_pages
        assert len(set(everything)) == len(
            everything), "a KV page is in two places (free / tree / private)"
        assert len(everything) == self.pool.num_pages, (
            f"pages leaked: {len(private)} private + {len(tree_pages)} in the tree + "
            f"{len(self.free_pages)} free "
            f"!= {self.pool.num_pages}"
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
        if self.tree is None:
            return
        expected: dict[int, int] = {}
        tree_page_set = set(tree_pages)
        for req in holders:
            shared = self.req_pages[req.rid][: self.req_shared[req.rid]]
            assert set(
                shared) <= tree_page_set, f"request {req.rid}'s shared pages are not in the tree"
            node = req.last_node
            assert self._pages_of(
                self._path_slots(node)) == shared, f"request {req.rid}: row != its locked path"
            while node is not self.tree.root_node:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in self.tree.iter_nodes():
            assert node.lock_ref == expected.get(
                id(node), 0
            ), (
                f"{node}: lock_ref {node.lock_ref}, but {expected.get(id(node), 0)} running "
                "requests use it"
            )

    def _path_slots(self, node) -> torch.Tensor:
        parts = []
        while node is not self.tree.root_node:
            parts.append(node.value)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)
