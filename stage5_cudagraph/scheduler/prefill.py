"""The prefill adder: which waiting requests join the next prefill batch, and how many of their tokens.

Rules, in order:
1. A request whose prompt was cut by the previous pass (the chunked request) continues first.
2. Then waiting requests by priority (higher first, FCFS within a level; waiting raises priority over time).
3. The batch takes at most `token_budget` new tokens: a prompt that does not fit is cut into a chunk
   (chunked prefill), so one long prompt never stalls every decode for a whole long forward pass.
4. A request is admitted only if a page-table row and the KV pages for its chunk are free, keeping `reserve_pages`
   back so that the running requests can still decode. When the head of the queue does not fit, admission stops:
   letting smaller requests overtake it forever would starve it.
"""

from __future__ import annotations

from ..core import Batch, Req, ReqStatus
from .cache_manager import CacheManager


class PrefillAdder:
    def __init__(self, cache: CacheManager, token_budget: int):
        if token_budget < 1:
            raise ValueError(f"the prefill token budget must be >= 1, got {token_budget}")
        self.cache, self.token_budget = cache, token_budget

    def build(self, chunked: Req | None, waiting: list[Req], reserve_pages: int) -> tuple[Batch | None, list[Req]]:
        """-> (the prefill batch or None, the waiting requests it admitted). `waiting` is in priority order."""
        reqs, admitted, budget = [], [], self.token_budget
        for req in ([chunked] if chunked else []) + waiting:
            if budget == 0:
                break
            is_new = req.status is ReqStatus.WAITING
            if is_new and not self.cache.can_run():
                break  # every page-table row is taken: max_running_requests reached
            remaining = len(req.all_ids) - req.cached_len
            extend = min(remaining, budget)
            # Fit the chunk into the free pages (minus the decode reserve), rounding down to whole tokens.
            held = 0 if is_new else len(self.cache.req_pages[req.rid])
            avail_pages = self.cache.num_free_pages - reserve_pages
            extend = min(extend, (held + max(avail_pages, 0)) * self.cache.page_size - req.cached_len)
            if extend <= 0:
                break  # head-of-line request does not fit now; decoding will free pages
            if is_new:
                self.cache.acquire_row(req)
                req.status = ReqStatus.RUNNING
                admitted.append(req)
            req.set_chunk(extend)
            ok = self.cache.grow(req, req.device_len)
            assert ok, "pages were counted above"
            reqs.append(req)
            budget -= extend
        if not reqs:
            return None, []
        out_cache_loc = [s for r in reqs for s in self.cache.slots(r, r.cached_len, r.device_len)]
        return Batch(reqs, "prefill", out_cache_loc), admitted
