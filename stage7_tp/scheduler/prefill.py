"""The prefill adder: which waiting requests join the next prefill batch, and how many of their
tokens.

Rules, in order:
1. A request whose prompt was cut by the previous pass (the chunked request) continues first.
2. Then waiting requests by priority (higher first, FCFS within a level; waiting raises priority
   over time).
3. Two token budgets per batch, as in SGLang. `chunked_prefill_size`: the batch's prefill tokens;
   the request that crosses it is cut there (chunked prefill), so one long prompt never stalls every
   decode for a whole long forward pass, and at most one request is ever half-prefilled.
   `max_prefill_tokens`: a request that would take the batch past it waits for the next batch,
   unless it is the first (it binds when chunking is off: -1).
4. Memory, with look-ahead. A request is admitted only if a page-table row is free and the pool can
   hold its prompt *and* the tokens it may still generate (min(max_new_tokens,
   CLIP_MAX_NEW_TOKENS)), after what the running requests are expected to need. Running requests
   rarely use all their max_new_tokens (most stop at EOS), so each one is expected to need only
   `new_token_ratio` of its remaining budget (at least its next token); the scheduler lowers that
   ratio step by step while decoding goes well and raises it again when it had to preempt (see
   scheduler.py). A chunk that does not complete the prompt is charged its own tokens only. When the
   head of the queue does not fit, admission stops: letting smaller requests overtake it forever
   would starve it.
5. Stage 6, the prefix cache: a new request first looks its tokens up in the radix tree. The matched
   prefix is locked (eviction may not take it) and starts the request's page-table row; `cached_len`
   starts at its length (capped so that at least one token is computed: its logits give the first
   new token), and only the rest counts against the budgets. Unlocked tree pages count as available:
   they are evicted when the free list runs short, long before any running request would be
   preempted. Two new requests of one batch that share a prefix would both compute it (neither is in
   the tree yet): under the cache-aware order (lpm) the second waits one step and then finds it
   there; under fcfs arrival order wins and both compute it (SGLang deprioritizes only under its
   cache-aware policies).
"""

from __future__ import annotations

import math

import torch

from ..core import Batch, Req, ReqStatus
from ..radix_cache import RadixCache
from .cache_manager import CacheManager

# a request asking for more is estimated at this many (SGLang's default clip)
CLIP_MAX_NEW_TOKENS = 4096
# tokens two prompts of one batch may both compute before one of them waits
IN_BATCH_PREFIX_THRESHOLD = 32


class PrefillAdder:

    def __init__(self, cache: CacheManager, max_prefill_tokens: int,
                 chunked_prefill_size: int = -1):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if chunked_prefill_size == 0 or chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be >= 1, or -1 to disable chunking, got "
                             f"{chunked_prefill_size}")
        self.cache, self.max_prefill_tokens = cache, max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.out_of_pages = False  # the last build stopped at a request the pool could not hold

    def future_tokens(self, req: Req, max_context_len: int) -> int:
        """The most tokens the request may still add to its KV cache (clipped as SGLang does)."""
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return max(0, min(left, CLIP_MAX_NEW_TOKENS, max_context_len - len(req.all_ids)))

    def reserved_pages(self, running: list[Req], new_token_ratio: float,
                       max_context_len: int) -> int:
        """Pages the running requests are expected to need beyond what they hold: new_token_ratio of
        their remaining budget each, and at least the page of their next token."""
        pages = 0
        for r in running:
            expected = max(1, math.ceil(self.future_tokens(r, max_context_len) * new_token_ratio))
            pages += self.cache.pages_missing(r, r.cached_len + expected)
        return pages

    def shares_with_batch(self, in_batch: RadixCache, req: Req, matched: int) -> bool:
        """SGLang's in-batch prefix caching: a request that would compute, in the same batch as
        another, a prefix of IN_BATCH_PREFIX_THRESHOLD tokens or more that the other computes too
        waits one step."""
        shared = len(in_batch.match_prefix(req.all_ids[:-1]).indices)
        return shared - matched >= max(IN_BATCH_PREFIX_THRESHOLD, self.cache.page_size)

    def build(self, chunked: Req | None, waiting: list[Req], running: list[Req],
              new_token_ratio: float, max_context_len: int,
              cache_aware: bool = True) -> tuple[Batch | None, list[Req]]:
        """-> (the prefill batch or None, the waiting requests it admitted). `waiting` is in
        priority order; cache_aware: it was ordered by prefix match (lpm), so a request may wait for
        an in-batch prefix (rule 5). Sets `out_of_pages` when a request had to wait because the pool
        could not hold it."""
        reqs, admitted = [], []
        self.out_of_pages = False
        # token budgets left
        rem_input, rem_chunk = self.max_prefill_tokens, self.chunked_prefill_size
        reserved = self.reserved_pages(running, new_token_ratio, max_context_len)
        promised = 0  # pages of future tokens promised to the requests admitted so far
        # the prompts this batch computes (ids only: no slots)
        in_batch = RadixCache(self.cache.page_size)
        for req in ([chunked] if chunked else []) + waiting:
            is_new = req.status is ReqStatus.WAITING
            if is_new and not self.cache.can_run():
                break  # every page-table row is taken: max_running_requests reached
            # stage 6: the tree may already hold the start of its prompt; lock it while we decide
            if is_new:
                matched = self.cache.match_prefix(req)
                if cache_aware and self.shares_with_batch(in_batch, req, matched):
                    # next step it finds that prefix in the tree instead of computing it twice now
                    continue
                self.cache.lock(req)
            cached = matched if is_new else req.cached_len
            # only the uncached suffix is computed, and needs pages
            remaining = len(req.all_ids) - cached
            extend = remaining if rem_chunk is None else min(remaining, rem_chunk)
            if remaining > rem_input and reqs:
                extend = 0  # the batch is full: it waits for the next one
            # KV the request needs: this pass's tokens, and, once its prompt is complete, what it
            # may generate.
            future = self.future_tokens(req, max_context_len) if extend == remaining else 0
            held = cached // self.cache.page_size if is_new else len(self.cache.req_pages[req.rid])
            need_now = max(0, self.cache.pages_for(cached + extend) - held)
            need_later = self.cache.pages_for(cached + extend + future) - held - need_now
            # Available: free pages and evictable tree pages, minus the running requests' expected
            # needs.
            if (
                extend == 0
                or need_now + need_later > self.cache.num_available_pages - reserved - promised
            ):
                if is_new:
                    self.cache.unlock(req)
                self.out_of_pages = extend > 0
                # head-of-line request does not fit now; decoding (or eviction) will free pages
                break
            if is_new:
                # its row starts with the matched pages; cached_len = matched
                self.cache.acquire_row(req)
                if req.num_preemptions == 0:
                    # prompt tokens served from the cache (reported per request)
                    req.cached_tokens = matched
                req.status = ReqStatus.RUNNING
                admitted.append(req)
            req.set_chunk(extend)
            # evicts unlocked tree pages if the free list is short
            ok = self.cache.grow(req, req.device_len)
            assert ok, "pages were counted above"
            promised += need_later
            reqs.append(req)
            in_batch.insert(req.all_ids, torch.zeros(len(req.all_ids), dtype=torch.int64))
            rem_input -= extend
            if rem_chunk is not None:
                rem_chunk -= extend
            if extend < remaining or rem_input <= 0 or rem_chunk == 0:
                break  # cut (the batch's one chunked request), or no budget left
        if not reqs:
            return None, []
        out_cache_loc = [s for r in reqs for s in self.cache.slots(r, r.cached_len, r.device_len)]
        return Batch(reqs, "prefill", out_cache_loc), admitted
