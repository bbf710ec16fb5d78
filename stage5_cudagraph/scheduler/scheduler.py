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
at launch, so such a request is not fed again. Two cases need the real tokens before building, and
drain the pipeline first (process N-1, then build): penalties (they read every previous token on the
host) and a decode step that must preempt (recompute needs the tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..core import Batch, Req
from ..detokenizer import IncrementalDetokenizer
from ..engine import Engine
from .cache_manager import CacheManager
from .decode import DecodeManager
from .metrics import StepStats, log_decode_stats
from .output_processor import StepOutput, finish_request, is_launched, process_batch_result
from .overlap import DeviceWorker, Pending, StepTiming
from .prefill import PrefillAdder
from .run_batch import run_batch

# SGLang's defaults for the admission estimate (see the module docstring and prefill.py).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20  # after a preemption, assume each survivor decodes this many more tokens


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
    waiting: list[Req] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    timings: list[StepTiming] = field(default_factory=list)  # per step, when record_stats

    def __post_init__(self) -> None:
        self.cache = CacheManager(self.engine.kv_pool, self.engine.page_table)
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
        if self.overlap is None:
            self.overlap = self.engine.device.type == "cuda"
        self.worker = DeviceWorker(self.engine.device, self.overlap)
        # launched, results not yet read
        self.inflight: list[tuple[Batch, list[tuple[Req, int]], Pending]] = []
        # finished, but still in a launched batch: pages released after it
        self.deferred: list[Req] = []
        # results read early by a drain, returned by this step
        self.ready_outputs: list[StepOutput] = []

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, req: Req) -> None:
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
        req.arrival = self.step_count
        self.reqs[req.rid] = req
        if self.tokenizer is not None:
            self.detok[req.rid] = IncrementalDetokenizer(self.tokenizer, params.stop_strings)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.engine.device).manual_seed(params.seed)
        self.generators[req.rid] = gen
        self.waiting.append(req)

    def abort(self, rid: int) -> None:
        req = self.reqs.get(rid)
        if req is not None and is_launched(self, req):
            # read its launched tokens first: no placeholder stays in its output, its pages free now
            self.drain()
            req = self.reqs.get(rid)  # None if those tokens finished it anyway
        if req is not None:
            finish_request(self, req, "abort")
            self.detok.pop(rid, None)
            self.waiting = [r for r in self.waiting if r.rid != rid]
            self.decoder.remove_finished()
            if self.chunked is req:
                self.chunked = None

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def check_integrity(self) -> None:
        """The pool's books balance, and exactly the running requests (plus a chunked prompt) hold
        pages."""
        self.cache.check_integrity(self.decoder.running)
        holders = {r.rid
                   for r in self.decoder.running + self.deferred
                   } | ({self.chunked.rid} if self.chunked else set())
        assert (
            set(self.cache.req_pages) == holders
        ), f"pages held by {sorted(self.cache.req_pages)} but running/chunked are {sorted(holders)}"
        assert not any(r.table_idx >= 0
                       for r in self.waiting), "a waiting request still holds a page-table row"

    # ---------------------------------------------------------------- one step
    def effective_priority(self, req: Req) -> int:
        return req.priority + (self.step_count - req.arrival) // self.priority_aging_steps

    def step(self) -> list[StepOutput]:
        self.step_count += 1
        start = time.perf_counter()
        if self.inflight and any(r.sampling_params.has_penalties for r in self.reqs.values()):
            self.drain()  # penalties read every earlier token on the host: no placeholders allowed
        batch, preempted = self.schedule()
        if batch is not None:
            run_batch(self, batch, start)
        # With overlap, leave the step just launched running and read the one before; without, read
        # it now.
        while len(self.inflight) > (1 if self.overlap and batch is not None else 0):
            self.ready_outputs += process_batch_result(self, *self.inflight.pop(0))
        if self.inflight and not self.reqs:
            # only finished requests are still launched: nothing to overlap, free their pages now
            self.drain()
        outputs, self.ready_outputs = self.ready_outputs, []
        if batch is not None:
            if self.record_stats:
                self.stats.append(
                    StepStats(self.step_count, batch.phase, batch.size, len(batch.out_cache_loc),
                              len(self.decoder.running), len(self.waiting),
                              self.cache.num_used_pages, len(preempted),
                              time.perf_counter() - start))
            log_decode_stats(self, batch, len(outputs))
        return outputs

    def schedule(self) -> tuple[Batch | None, list[Req]]:
        """Stage 4's choice of the next batch; with overlap, on host state that already counts
        launched steps."""
        self.waiting.sort(key=lambda r: (-self.effective_priority(r), r.arrival, r.rid))
        batch, preempted = None, []
        # Prefill first (new requests join the decode batch sooner), except that a prompt being
        # prefilled in chunks alternates with decode steps: that is what chunking is for.
        if not (self.chunked is not None and self.last_phase == "prefill" and self.decoder.running):
            batch, admitted = self.prefill_adder.build(self.chunked, self.waiting,
                                                       self.decoder.running, self.new_token_ratio,
                                                       self.engine.max_context_len)
            if batch is not None:
                self.waiting = [r for r in self.waiting if r not in admitted]
                return batch, []
        if self.inflight:
            missing = sum(self.cache.pages_missing(r, r.device_len)
                          for r in self.decoder.candidates(self.done_launching))
            if missing > self.cache.num_free_pages:
                # preemption resets a request to its host tokens: read the launched ones first
                self.drain()
        batch, preempted = self.decoder.build(
            lambda r: (self.effective_priority(r), -r.arrival, -r.rid), self.done_launching)
        self.waiting.extend(preempted)
        self.total_preemptions += len(preempted)
        self.update_new_token_ratio(preempted)
        return batch, preempted

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

    def drain(self) -> None:
        """Read every launched step now (the pipeline empties; its outputs go out with this
        step's)."""
        while self.inflight:
            self.ready_outputs += process_batch_result(self, *self.inflight.pop(0))
