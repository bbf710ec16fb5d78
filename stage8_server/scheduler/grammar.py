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

A grammar may take only so long to compile (grammar_compile_timeout, counted from the request's
arrival): past it, its request fails alone with an error naming the limit. A compile cannot be
interrupted: it finishes on its thread and stays cached, so a request sending the same grammar again
does not start another one. Whether a compile ran out of time is a wall-clock matter that differs
between ranks, so the ranks agree on it too: the all-reduce takes, for each queued request, the
furthest any rank got (0 compiling, 1 compiled or failed, 2 out of time), and a request that ran out
of time on any rank fails on all of them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from typing import Callable

import torch

from ..constrained import GrammarBackend, clean_message
from ..core import Req


COMPILING, DONE, OUT_OF_TIME = 0, 1, 2  # a queued request's state, as the ranks agree on it


class GrammarManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend], compile_timeout: float = 30.0):
        if not compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 s, got {compile_timeout}")
        # the backend (thread pool, tokenizer info) is built on first use
        self.make_backend = make_backend
        self.backend: GrammarBackend | None = None
        self.queue: list[Req] = []  # waiting for their grammar to compile, in arrival order
        self.compile_timeout = compile_timeout
        self.deadlines: dict[int, float] = {}  # rid -> when its compile runs out of time
        # tensor parallelism: the element-wise max of a list of ints over the ranks
        self.sync: Callable[[list[int]], list[int]] | None = None

    def add(self, req: Req) -> bool:
        """Queue req if it has a grammar (-> True); else leave it to the waiting queue (False)."""
        key = req.sampling_params.grammar
        if key is None:
            return False
        if self.backend is None:
            self.backend = self.make_backend()
        req.grammar = self.backend.get_future(key)
        self.queue.append(req)
        self.deadlines[req.rid] = time.monotonic() + self.compile_timeout
        return True

    def remove(self, req: Req) -> None:
        self.queue = [r for r in self.queue if r is not req]
        self.deadlines.pop(req.rid, None)

    def wait(self, timeout: float) -> None:
        """Sleep until the head of the queue is compiled, at most timeout s (when nothing else can
        run)."""
        if self.queue:
            wait([self.queue[0].grammar], timeout)

    def pop_ready(self) -> list[Req]:
        """The head of the queue whose grammars are done (or out of time), in order, each with its
        own matcher, or with req.error set when its grammar failed to compile in time."""
        now = time.monotonic()
        states = [DONE if r.grammar.done() else
                  OUT_OF_TIME if now >= self.deadlines[r.rid] else COMPILING for r in self.queue]
        if self.sync is not None and states:
            states = self.sync(states)  # every rank moves as far as the rank furthest ahead
        n = next((i for i, state in enumerate(states) if state == COMPILING), len(states))
        ready, self.queue = self.queue[:n], self.queue[n:]
        for req, state in zip(ready, states):
            del self.deadlines[req.rid]
            future: Future = req.grammar
            if state == OUT_OF_TIME:
                req.grammar, req.error = None, (
                    f"the request's grammar did not compile within grammar_compile_timeout = "
                    f"{self.compile_timeout:g} s; simplify it")
                continue
            try:
                compiled = future.result()  # at once, except on a rank behind the others
                req.grammar = self.backend.matcher(compiled)
            except Exception as exc:  # noqa: BLE001 — the request fails alone, with the reason
                req.grammar, req.error = None, clean_message(exc)
        return ready

    def fill_mask(self, reqs: list[Req], device: torch.device,
                  on_error: Callable[[Req, Exception], None]) -> tuple[torch.Tensor,
                                                                     list[int]] | None:
        """The bitmask of a batch's sampled requests: [S, ceil(vocab / 32)] int32 on `device`, and
        the rows that carry a grammar (the others are not masked). None: no request of the batch has
        one. A matcher that raises is reported to on_error (its request fails alone, this step's
        token is dropped) and its row left unmasked."""
        rows = [j for j, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        mask = self.backend.allocate_mask(len(reqs))  # [S, words], all bits set
        for j in list(rows):
            try:
                reqs[j].grammar.fill_next_token_bitmask(mask, j)
            except Exception as exc:  # noqa: BLE001 — this request alone fails
                on_error(reqs[j], exc)
                rows.remove(j)
                mask[j] = -1  # every bit set again: the row may be half filled
        if not rows:
            return None
        if device.type == "cuda":  # pinned, without blocking: see sampler._on_device
            return mask.pin_memory().to(device, non_blocking=True), rows
        return mask.to(device), rows

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
