"""The decode manager: the running requests, one token each per decode pass, and preemption when
pages run out.

Before each decode pass every running request needs a KV slot for the token it feeds. When the pool
is empty, the lowest-priority, most recently arrived request is preempted: its pages are released
and it goes back to the waiting queue to be recomputed later (prompt + output so far, prefilled
again) — slower for that request, but the engine never crashes and never loses a token it already
produced.

Stage 5 (overlap): a request whose last token is still being computed stays in `running` until the
scheduler has read that token; `done_launching(req)` says it must not be fed again (its launched
tokens already reach max_new_tokens or the context), so it is left out of the batch.
"""

from __future__ import annotations

from ..core import Batch, Req
from .cache_manager import CacheManager


class DecodeManager:
    def __init__(self, cache: CacheManager):
        self.cache = cache
        self.running: list[Req] = []

    def add(self, req: Req) -> None:
        self.running.append(req)

    def remove_finished(self) -> list[Req]:
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done

    def candidates(self, done_launching=None) -> list[Req]:
        return [r for r in self.running if done_launching is None or not done_launching(r)]

    def build(self, victim_order, done_launching=None) -> tuple[Batch | None, list[Req]]:
        """-> (the decode batch or None, the requests preempted to make room). victim_order: sort
        key, first = evict."""
        preempted: list[Req] = []
        while True:
            short = [
                r for r in self.candidates(done_launching) if not self.cache.grow(r, r.device_len)
            ]
            if not short:
                break
            # Not enough pages for everyone's next token: evict until what is left fits.
            victim = sorted(self.running, key=victim_order)[0]
            self.running.remove(victim)
            self.cache.release(victim)
            victim.reset_for_recompute()
            preempted.append(victim)
        reqs = self.candidates(done_launching)
        if not reqs:
            return None, preempted
        out_cache_loc = [s for r in reqs for s in self.cache.slots(r, r.cached_len, r.device_len)]
        return Batch(reqs, "decode", out_cache_loc), preempted
