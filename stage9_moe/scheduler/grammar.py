"""The grammar manager: structured-output requests on their way in, and their masks on every step.

    add_request(req with a grammar) -> grammar queue, req.grammar = Future of the compiled grammar
    each step: pop_ready()  the compiled head of the queue -> waiting queue, each with a matcher (a
                            grammar that failed to compile: its request finishes with "error")
    launch:    fill_mask()  one bitmask row per constrained request of the batch, filled on the host

A request whose grammar is still compiling waits in the grammar queue, not in the waiting queue: the
scheduler never blocks on a compile, and the other requests keep running (SGLang's grammar_queue).
The queue keeps arrival order: a request never overtakes an earlier one whose grammar is slower to
compile.

Tensor parallelism: every rank runs its own scheduler, compiles its own grammars and runs its own
matchers (the same logits on every rank give the same mask and the same token). Compile times differ
between ranks, though, and a request admitted at step 5 on one rank and step 6 on another would
break the lockstep. So the ranks agree on how many requests leave the queue: the most any rank has
ready (an all-reduce over the control group, as in SGLang's move_ready_grammar_requests); a rank
that is behind waits for those compiles to finish.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Callable

import torch

from ..constrained import GrammarBackend, clean_message
from ..core import Req


class GrammarManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend]):
        # the backend (thread pool, tokenizer info) is built on first use
        self.make_backend = make_backend
        self.backend: GrammarBackend | None = None
        self.queue: list[Req] = []  # waiting for their grammar to compile, in arrival order
        # tensor parallelism: the max of a count over the ranks
        self.sync: Callable[[int], int] | None = None

    def add(self, req: Req) -> bool:
        """Queue req if it has a grammar (-> True); else leave it to the waiting queue (False)."""
        key = req.sampling_params.grammar
        if key is None:
            return False
        if self.backend is None:
            self.backend = self.make_backend()
        req.grammar = self.backend.get_future(key)
        self.queue.append(req)
        return True

    def remove(self, req: Req) -> None:
        self.queue = [r for r in self.queue if r is not req]

    def wait(self, timeout: float) -> None:
        """Sleep until the head of the queue is compiled, at most timeout s (when nothing else can
        run)."""
        if self.queue:
            wait([self.queue[0].grammar], timeout)

    def pop_ready(self) -> list[Req]:
        """The head of the queue whose grammars are done, in order, each with its own matcher, or
        with req.error set when its grammar failed to compile."""
        n = 0
        while n < len(self.queue) and self.queue[n].grammar.done():
            n += 1
        if self.sync is not None:
            n = self.sync(n)  # every rank moves as many as the rank furthest ahead
        ready, self.queue = self.queue[:n], self.queue[n:]
        for req in ready:
            future: Future = req.grammar
            try:
                compiled = future.result()  # at once, except on a rank behind the others
            except Exception as exc:  # noqa: BLE001 — the request fails alone, with the reason
                req.grammar, req.error = None, clean_message(exc)
            else:
                req.grammar = self.backend.matcher(compiled)
        return ready

    def fill_mask(self, reqs: list[Req],
                  device: torch.device) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of a batch's sampled requests: [S, ceil(vocab / 32)] int32 on `device`, and
        the rows that carry a grammar (the others are not masked). None: no request of the batch has
        one."""
        rows = [j for j, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        mask = self.backend.allocate_mask(len(reqs))  # [S, words], all bits set
        for j in rows:
            reqs[j].grammar.fill_next_token_bitmask(mask, j)
        if device.type == "cuda":  # pinned, without blocking: see sampler._on_device
            return mask.pin_memory().to(device, non_blocking=True), rows
        return mask.to(device), rows

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
