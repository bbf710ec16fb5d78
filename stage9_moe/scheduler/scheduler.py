"""The scheduler loop: one `step()` = pick a batch, run one forward pass, sample, update every
request.

    add_request(req)   -> waiting queue
    step():
        prefill batch if any waiting request (or a chunked prompt) fits   (PrefillAdder)
        else decode batch of every running request, preempting if pages ran out   (DecodeManager)
        engine.forward(batch) -> logits [B, vocab]
        sample; append tokens; detokenize; stop checks; finished requests release their pages

Continuous batching is simply this loop: requests join at any step through a prefill, and leave the
decode batch the step they finish, instead of a batch living and dying together (stage 2).

How much to admit is a bet on the future: a running request may generate up to max_new_tokens more
tokens, but most stop early. SGLang's `new_token_ratio` is that bet: admission expects each running
request to need this share of its remaining budget. It starts at `init_new_token_ratio` (0.7 x
schedule_conservativeness), falls a little each decode step that needed no preemption (down to
min_new_token_ratio), and after a preemption is set to what the surviving requests really used so
far, so admission becomes careful again exactly when it was too bold.

Beside this loop: output_processor.py turns a step's tokens into StepOutputs (stop checks,
finishing requests), metrics.py keeps the StepStats and logs the throughput.

Stage 6, the prefix cache: admission looks each prompt up in the radix tree (PrefillAdder); each
prefilled prompt, and each chunk of one, goes into the tree at once (CacheManager.cache_unfinished);
a request that ends puts the rest of its pages there (CacheManager.release). The waiting queue is
ordered cache-aware within a priority level (`schedule_policy="lpm"`, longest prefix match first:
requests that share a cached prefix run while it is cached), or first come first served (`"fcfs"`).
Ordering costs a tree walk per waiting request, so it is done only in a step that can build a
prefill (a page-table row is free, and no request is still waiting for pages since the last ones
were given back: SGLang's `batch_is_full`).

Stage 5, overlap scheduling ("zero-overhead" scheduler): each step *launches* batch N and then
processes the results of batch N-1 while N runs, so the device never waits for the CPU's
bookkeeping. A batch is launched by run_batch (run_batch.py) and read back by process_batch_result
(output_processor.py).

    step():
        build batch N (host state was advanced when N-1 launched: positions and KV slots are known,
        the token
                       N-1 sampled is not -> its input id is a placeholder -(row + 1), resolved on
                       the device from engine.future_tokens, where N-1's sampler left it)
        launch N on the device worker process N-1: read its tokens, fill in the placeholders, stop
        checks, detokenize, free finished requests

A request that N-1 finished (EOS, stop string: unknowable before its token is read) is usually in
batch N already: its extra token is dropped, and its pages are released only once N completed (no
page is reused while a launched batch may still write to it). Finishing by max_new_tokens is known
at launch, so such a request is not fed again. Three cases need the real tokens before building, and
drain the pipeline first (process N-1, then build): penalties (they read every previous token on the
host), a decode step that must preempt (recompute needs the tokens), and, from stage 8, a request
with a grammar in flight (its next mask depends on the token N-1 sampled: grammar.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..constrained import GrammarBackend
from ..core import Batch, Req
from ..detokenizer import IncrementalDetokenizer
from ..engine import Engine
from ..radix_cache import RadixCache
from .cache_manager import CacheManager
from .decode import DecodeManager
from .grammar import GrammarManager
from .metrics import StepStats, log_decode_stats
from .output_processor import StepOutput, finish_request, is_launched, process_batch_result
from .overlap import DeviceWorker, Pending, StepTiming
from .prefill import PrefillAdder
from .run_batch import run_batch

logger = logging.getLogger(__name__)
# SGLang's defaults for the admission estimate (see the module docstring and prefill.py).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20  # after a preemption, assume each survivor decodes this many more tokens
SCHEDULE_POLICIES = ("lpm", "fcfs")
# longer waiting queues are ordered FCFS: matching each request every step would cost too much
LPM_MAX_QUEUE = 128
# with nothing else to run, wait this long for a grammar to compile (SGLang's poll)
GRAMMAR_POLL_S = 0.03


@dataclass
class Scheduler:
    engine: Engine
    tokenizer: object = None  # for text deltas and stop strings; None: token ids only
    max_prefill_tokens: int = 16384  # a prefill batch grows past this only with its first request
    # prefill tokens per batch; the request crossing it is cut (-1: never cut)
    chunked_prefill_size: int = 512
    # scales init_new_token_ratio: higher admits fewer requests
    schedule_conservativeness: float = 1.0
    # every this many steps waiting, a request's priority rises by one
    priority_aging_steps: int = 64
    log_interval: int = 0  # log throughput every N decode steps (0: never)
    record_stats: bool = False
    # Process step N-1's results while step N runs (False: stage 4's synchronous loop). None: on
    # CUDA only: on a CPU the forward would run on a second thread, and two threads running torch's
    # kernels slow both (README, Figures).
    overlap: bool | None = None
    disable_radix_cache: bool = False  # True: no prefix cache, stage 5's behaviour
    # waiting-queue order within a priority level: "lpm" (longest prefix match), "fcfs"
    schedule_policy: str = "lpm"
    # False: no text deltas (tensor-parallel ranks 1+); stop strings are still checked
    stream_text: bool = True
    # Stage 7: called after each step with (step, (batch shape, sampled tokens)) to compare them
    # across ranks
    tp_sync_check: Callable | None = None
    # Stage 8: a request whose grammar takes longer to compile fails alone (scheduler/grammar.py)
    grammar_compile_timeout: float = 30.0
    # Stage 9, speculative decoding (speculative/): decode batches become verify passes; no overlap
    speculative: object = None
    waiting: list[Req] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    timings: list[StepTiming] = field(default_factory=list)  # per step, when record_stats

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        tree = None if self.disable_radix_cache else RadixCache(self.engine.kv_pool.page_size)
        self.cache = CacheManager(self.engine.kv_pool, self.engine.page_table, tree)
        self.prefill_adder = PrefillAdder(self.cache, self.max_prefill_tokens,
                                          self.chunked_prefill_size)
        if self.schedule_conservativeness < 0:
            raise ValueError(
                f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * self.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (self.init_new_token_ratio -
                                      self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        self.decoder = DecodeManager(self.cache)
        self.chunked: Req | None = None  # the request whose prompt is being prefilled in chunks
        self.reqs: dict[int, Req] = {}  # every unfinished request by rid
        self.detok: dict[int, IncrementalDetokenizer] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self.step_count = 0
        self.total_preemptions = 0
        self.last_phase = "decode"
        self._log_tokens, self._log_time = 0, time.perf_counter()
        if self.speculative is not None:  # drafts are proposed from the tokens on the host
            self.overlap = False
        if self.overlap is None:
            self.overlap = self.engine.device.type == "cuda"
        self.worker = DeviceWorker(self.engine.device, self.overlap)
        # launched, results not yet read
        self.inflight: list[tuple[Batch, list[tuple[Req, int]], Pending]] = []
        # finished, but still in a launched batch: pages released after it
        self.deferred: list[Req] = []
        # results read early by a drain, returned by this step
        self.ready_outputs: list[StepOutput] = []
        # prompt tokens of every admission, and those from the tree
        self.admitted_tokens = self.cached_tokens = 0
        # a waiting request did not fit: no prefill until some request frees pages
        self.batch_is_full = False
        # Stage 8, structured outputs: requests whose grammar compiles, and every constrained
        # batch's mask.
        self.grammars = GrammarManager(lambda: GrammarBackend(
            self.tokenizer.hf, self.engine.config.vocab_size, self.engine.eos_token_ids),
            self.grammar_compile_timeout)
        # One request must never stop the others: requests whose own work raised this step (rid ->
        # why), ended with an error at the end of the step (fail_requests).
        self.failures: dict[int, str] = {}
        # tensor parallelism: every rank's failures -> their union, the same on every rank
        self.failure_sync: Callable[[dict[int, str]], dict[int, str]] | None = None

    # ---------------------------------------------------------------- requests in and out
    def check_request(self, req: Req) -> None:
        """Raise ValueError, naming the problem, if add_request would refuse the request; changes
        nothing."""
        params = req.sampling_params
        params.validate()
        self.engine.check_prompt_fits(len(req.input_ids))
        pool_tokens = self.cache.pool.num_pages * self.cache.page_size
        if min(req.max_device_len, self.engine.max_context_len) > pool_tokens:
            raise ValueError(
                f"request needs up to {req.max_device_len} tokens of KV cache (prompt + "
                f"max_new_tokens) but the whole pool holds {pool_tokens}; shorten the prompt or "
                "max_new_tokens")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if params.grammar is not None and self.tokenizer is None:
            raise ValueError("structured outputs (json_schema, regex, ebnf) need a tokenizer")
        if self.speculative is not None:
            self.speculative.check_request(req)

    def add_request(self, req: Req) -> None:
        """Every rank runs this when a step applies its operations (LLM.add_req checked the request
        already). Anything that still raises here (a seed torch refuses, say) fails this request
        alone, at the end of the step: the step goes on."""
        req.arrival = self.step_count
        self.reqs[req.rid] = req
        try:
            self.check_request(req)
            params = req.sampling_params
            if self.tokenizer is not None and (self.stream_text or params.stop_strings):
                self.detok[req.rid] = IncrementalDetokenizer(self.tokenizer, params.stop_strings)
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.engine.device).manual_seed(params.seed)
            self.generators[req.rid] = gen
            # a request with a grammar waits for it in the grammar queue first
            if not self.grammars.add(req):
                self.waiting.append(req)
        except Exception as exc:  # noqa: BLE001 — queued nowhere: it waits for fail_requests
            self.record_failure(req, exc, "adding it")

    def abort(self, rid: int) -> None:
        req = self.reqs.get(rid)
        if req is not None and is_launched(self, req):
            # read its launched tokens first: no placeholder stays in its output, its pages free now
            self.drain()
            req = self.reqs.get(rid)  # None if those tokens finished it anyway
        if req is not None:
            self.end_now(req, "abort")

    def end_now(self, req: Req, reason: str) -> None:
        """Finish req wherever it is (grammar queue, waiting, running, chunked): an abort or a
        failure."""
        finish_request(self, req, reason)
        self.detok.pop(req.rid, None)
        self.waiting = [r for r in self.waiting if r is not req]
        self.grammars.remove(req)
        self.decoder.remove_finished()
        if self.chunked is req:
            self.chunked = None

    # ---------------------------------------------------------------- one request fails alone
    def record_failure(self, req: Req, exc: Exception, doing: str) -> None:
        """Serving req alone raised (adding it, filling its grammar mask, reading its token): it
        ends with an error at the end of this step (fail_requests); the others go on."""
        logger.exception("request %s failed while %s", req.rid, doing)
        self.failures.setdefault(req.rid, f"internal error while {doing}: "
                                          f"{type(exc).__name__}: {exc}")

    def fail_requests(self) -> list[StepOutput]:
        """End this step's failed requests, each with its error (its pages freed, not cached). With
        tensor parallelism the ranks first agree (failure_sync: the union of every rank's), so that
        every rank drops the same requests at the same step, even one only rank 0 saw fail (text
        streaming runs there alone)."""
        failures, self.failures = self.failures, {}
        if self.failure_sync is not None:
            failures = self.failure_sync(failures)
        outputs = []
        for rid, error in sorted(failures.items()):
            req = self.reqs.get(rid)
            if req is None:  # finished meanwhile
                continue
            req.error = error
            self.end_now(req, "error")
            outputs.append(StepOutput(rid, [], "", True, "error", req, error=error,
                                      error_code="internal_error"))
        return outputs

    def fail_batch(self, batch: Batch, exc: Exception) -> list[StepOutput]:
        """A launched pass raised (forward or sampling): no request can be blamed, and none has its
        token, so every request of the batch ends with an error, and the prefix cache forgets what
        no running request holds (the pass may have left pages it was writing unwritten). Every
        rank runs the same pass, so every rank fails it the same way (or a rank died: TPError)."""
        logger.error("a %s pass of %d requests failed: %r", batch.phase, batch.size, exc)
        error = f"internal error in this request's batch: {type(exc).__name__}: {exc}"
        outputs = []
        for req in batch.reqs:
            if req.finished:
                continue
            req.error = error
            self.end_now(req, "error")
            outputs.append(StepOutput(req.rid, [], "", True, "error", req, error=error,
                                      error_code="internal_error"))
        self.flush_cache()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def check_integrity(self) -> None:
        """The pool's books balance (free / tree / private), and exactly the running requests (plus
        a chunked prompt and finished requests still in flight) hold pages and tree locks."""
        holders = self.decoder.running + self.deferred + ([self.chunked] if self.chunked else [])
        self.cache.check_integrity(self.decoder.running, holders)
        assert set(self.cache.req_pages) == {
            r.rid for r in holders
        }, (
            f"pages held by {sorted(self.cache.req_pages)} but running/chunked are "
            f"{sorted(r.rid for r in holders)}"
        )
        assert not any(r.table_idx >= 0
                       for r in self.waiting), "a waiting request still holds a page-table row"

    # ---------------------------------------------------------------- one step
    def effective_priority(self, req: Req) -> int:
        return req.priority + (self.step_count - req.arrival) // self.priority_aging_steps

    def step(self) -> list[StepOutput]:
        self.step_count += 1
        start = time.perf_counter()
        if self.grammars.queue:
            self.move_ready_grammar_requests()
        if self.inflight and (any(r.sampling_params.has_penalties for r in self.reqs.values()) or
                              any(r.grammar is not None for b, _, _ in self.inflight
                                  for r in b.reqs)):
            # Penalties read every earlier token on the host, no placeholders allowed; a grammar's
            # next mask needs its matcher advanced by the token in flight. Those steps run without
            # overlap.
            self.drain()
        batch, preempted = self.schedule()
        shape = None
        if batch is not None:
            if self.tp_sync_check is not None:
                shape = (batch.phase, [(r.rid, r.cached_len, r.extend_len) for r in batch.reqs])
            # speculative decoding: a decode batch is verified (None: nothing drafted, decode)
            verified = (self.speculative.run(self, batch)
                        if self.speculative is not None and batch.phase == "decode" else None)
            if verified is None:
                run_batch(self, batch, start)
            else:
                self.ready_outputs += verified
        # With overlap, leave the step just launched running and read the one before; without, read
        # it now.
        while len(self.inflight) > (1 if self.overlap and batch is not None else 0):
            self.ready_outputs += process_batch_result(self, *self.inflight.pop(0))
        if self.inflight and not self.reqs:
            # only finished requests are still launched: nothing to overlap, free their pages now
            self.drain()
        if self.speculative is not None:  # a finished request's draft-model pages go back
            self.speculative.release_finished(self.decoder.running)
        outputs, self.ready_outputs = self.ready_outputs, []
        if self.failures or self.failure_sync is not None:  # tp > 1: every rank, every step
            failed = self.fail_requests()
            if failed:  # a failed request's output this step is its error alone
                dropped = {o.rid for o in failed}
                outputs = [o for o in outputs if o.rid not in dropped] + failed
        if batch is not None:
            if self.record_stats:
                self.stats.append(
                    StepStats(self.step_count, batch.phase, batch.size, len(batch.out_cache_loc),
                              len(self.decoder.running), len(self.waiting),
                              self.cache.num_used_pages, len(preempted),
                              time.perf_counter() - start, self.cache_hit_rate, self.tree_tokens))
            log_decode_stats(self, batch, len(outputs))
        if self.tp_sync_check is not None:
            self.tp_sync_check(self.step_count,
                               (shape, [(o.rid, o.new_token_ids) for o in outputs]))
        return outputs

    def move_ready_grammar_requests(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; a grammar that failed ends its
        request."""
        if not (self.waiting or self.decoder.running or self.inflight or self.chunked):
            # nothing else to do: sleep on the compile instead of spinning
            self.grammars.wait(GRAMMAR_POLL_S)
        for req in self.grammars.pop_ready():
            if req.error is None:
                self.waiting.append(req)
                continue
            finish_request(self, req, "error")
            self.detok.pop(req.rid, None)
            self.ready_outputs.append(
                StepOutput(req.rid, [], "", True, "error", req, error=req.error))

    def schedule(self) -> tuple[Batch | None, list[Req]]:
        """Stage 4's choice of the next batch; with overlap, on host state that already counts
        launched steps."""
        batch, preempted = None, []
        # Prefill first (new requests join the decode batch sooner), except that a prompt being
        # prefilled in chunks alternates with decode steps: that is what chunking is for.
        if self.prefill_possible():
            cache_aware = self.sort_waiting()
            batch, admitted = self.prefill_adder.build(self.chunked, self.waiting,
                                                       self.decoder.running, self.new_token_ratio,
                                                       self.engine.max_context_len, cache_aware)
            # SGLang's batch_is_full: a request the pool cannot hold now waits until some request
            # gives pages back
            self.batch_is_full = self.prefill_adder.out_of_pages
            if batch is not None:
                self.waiting = [r for r in self.waiting if r not in admitted]
                self.admitted_tokens += sum(len(r.all_ids) for r in admitted)
                self.cached_tokens += sum(len(r.prefix_indices) for r in admitted)
                return batch, []
        if self.inflight:
            missing = sum(self.cache.pages_missing(r, r.device_len)
                          for r in self.decoder.candidates(self.done_launching))
            if missing > self.cache.num_available_pages:
                # preemption resets a request to its host tokens: read the launched ones first
                self.drain()
        batch, preempted = self.decoder.build(
            lambda r: (self.effective_priority(r), -r.arrival, -r.rid), self.done_launching)
        self.waiting.extend(preempted)
        self.batch_is_full = self.batch_is_full and not preempted  # their pages are free again
        self.total_preemptions += len(preempted)
        self.update_new_token_ratio(preempted)
        return batch, preempted

    def prefill_possible(self) -> bool:
        """Can this step build a prefill batch at all? Asked before the waiting queue is ordered,
        because ordering it costs a tree walk per request (tens of milliseconds a step for a hundred
        long waiting prompts), wasted whenever the answer is no; SGLang's get_new_batch_prefill
        returns early the same way before calc_priority."""
        # a prompt prefilled in chunks continues, alternating with decode steps
        if self.chunked is not None:
            return not (self.last_phase == "prefill" and self.decoder.running)
        return bool(self.waiting) and self.cache.can_run() and not self.batch_is_full

    def sort_waiting(self) -> bool:
        """Priority (with ageing) first; within a level, longest cached prefix first ("lpm") or
        arrival order. Matching every waiting request costs a tree walk each, so, as SGLang does, a
        long queue falls back to FCFS. -> whether the order was cache-aware."""
        lpm = self.schedule_policy == "lpm" and self.cache.tree is not None and len(
            self.waiting) <= LPM_MAX_QUEUE
        matched = {r.rid: self.cache.match_prefix(r) if lpm else 0 for r in self.waiting}
        self.waiting.sort(
            key=lambda r: (-self.effective_priority(r), -matched[r.rid], r.arrival, r.rid))
        return lpm

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.admitted_tokens if self.admitted_tokens else 0.0

    @property
    def tree_tokens(self) -> int:
        tree = self.cache.tree
        return tree.evictable_size + tree.protected_size if tree else 0

    def flush_cache(self) -> None:
        """Empty the prefix cache of everything no running request uses (SGLang's /flush_cache)."""
        self.cache.flush()
        self.batch_is_full = False

    def done_launching(self, req: Req) -> bool:
        """Its launched tokens already reach max_new_tokens or the context: feed it no more."""
        return (len(req.output_ids) >= req.sampling_params.max_new_tokens
                or req.device_len >= self.engine.max_context_len)

    def update_new_token_ratio(self, preempted: list[Req]) -> None:
        """After a decode batch was built: decay the estimate, or, if it had to preempt, reset it to
        what the requests still running have really generated (SGLang's retract estimate) so
        admission backs off."""
        running = self.decoder.running
        if not running:
            self.new_token_ratio = self.init_new_token_ratio
        elif preempted:
            decoded = sum(len(r.output_ids) for r in running) + RETRACT_DECODE_STEPS * len(running)
            budget = sum(r.sampling_params.max_new_tokens for r in running)
            self.new_token_ratio = min(1.0, max(decoded / budget, self.new_token_ratio))
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay,
                                       self.min_new_token_ratio)

    def shutdown(self) -> None:
        """Read back what is still in flight, then stop the device worker (LLM.close), even if that
        step failed."""
        try:
            self.drain()
        finally:
            self.worker.shutdown()
            self.grammars.shutdown()

    def drain(self) -> None:
        """Read every launched step now (the pipeline empties; its outputs go out with this
        step's)."""
        while self.inflight:
            self.ready_outputs += process_batch_result(self, *self.inflight.pop(0))
