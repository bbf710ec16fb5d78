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
"""

from __future__ import annotations

import math

from ..core import Batch, Req, ReqStatus
from .cache_manager import CacheManager

# a request asking for more is estimated at this many (SGLang's default clip)
CLIP_MAX_NEW_TOKENS = 4096


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

    def build(self, chunked: Req | None, waiting: list[Req], running: list[Req],
              new_token_ratio: float, max_context_len: int) -> tuple[Batch | None, list[Req]]:
        """-> (the prefill batch or None, the waiting requests it admitted). `waiting` is in
        priority order."""
        reqs, admitted = [], []
        # token budgets left
        rem_input, rem_chunk = self.max_prefill_tokens, self.chunked_prefill_size
        # Pages free now, minus what the running requests are expected to need.
        avail_pages = self.cache.num_free_pages - self.reserved_pages(running, new_token_ratio,
                                                                      max_context_len)
        for req in ([chunked] if chunked else []) + waiting:
            is_new = req.status is ReqStatus.WAITING
            if is_new and not self.cache.can_run():
                break  # every page-table row is taken: max_running_requests reached
            remaining = len(req.all_ids) - req.cached_len
            if remaining > rem_input and reqs:
                break  # the batch is full: it waits for the next one
            extend = remaining if rem_chunk is None else min(remaining, rem_chunk)
            # KV the request needs: this pass's tokens, and, once its prompt is complete, what it
            # may generate.
            future = self.future_tokens(req, max_context_len) if extend == remaining else 0
            need = self.cache.pages_missing(req, req.cached_len + extend + future)
            if need > avail_pages:
                break  # head-of-line request does not fit now; decoding will free pages
            if is_new:
                self.cache.acquire_row(req)
                req.status = ReqStatus.RUNNING
                admitted.append(req)
            req.set_chunk(extend)
            ok = self.cache.grow(req, req.device_len)
            assert ok, "pages were counted above"
            avail_pages -= need  # the pages of its future tokens stay promised to it
            reqs.append(req)
            rem_input -= extend
            if rem_chunk is not None:
                rem_chunk -= extend
            if extend < remaining or rem_input <= 0 or rem_chunk == 0:
                break  # cut (the batch's one chunked request), or no budget left
        if not reqs:
            return None, []
        out_cache_loc = [s for r in reqs for s in self.cache.slots(r, r.cached_len, r.device_len)]
        return Batch(reqs, "prefill", out_cache_loc), admitted
