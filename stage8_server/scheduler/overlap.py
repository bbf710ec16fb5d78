"""The device side of the overlap scheduler: something that runs step N while the CPU prepares step
N+1.

    main thread (CPU)                       device worker
    build batch N+1, prepare tensors   |    forward N + sample N  (tokens stay on the device)
    read step N-1's tokens, stop        |
    checks, detokenize                  |

`DeviceWorker.submit(fn)` runs `fn` (forward + sample of one step) on a single worker thread, in
submission order, and returns a `Pending` whose `wait()` gives the step's host-side token ids.

- On CUDA, the worker launches onto its own *forward stream* (after waiting for the inputs the main
  thread copied on its stream), copies the tokens to pinned host memory without blocking, and
  records an event: the thread is free again as soon as the kernels are queued, and `wait()` blocks
  on the event only. The GPU queue never runs dry.
- On a CPU there is no asynchronous device: torch runs each op before returning. The worker thread
  *is* the device here: torch's kernels release the GIL, so the main thread's Python (scheduling,
  detokenizing) runs while the worker computes. It can only hide CPU work behind CPU work, on cores
  the matmuls would otherwise use: see the stage README for what that buys (and costs) on a small
  machine.
- With overlap disabled, `submit` runs `fn` at once in the caller's thread: the same loop, nothing
  hidden.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


@dataclass
class StepTiming:
    """When each part of one step happened (perf_counter seconds), for the timeline plot and
    utilisation."""

    step: int
    phase: str
    batch_size: int
    schedule: tuple[float, float]  # CPU: build the batch + prepare its tensors + launch
    # forward + sample (on CUDA: from events, on the host's clock)
    device: tuple[float, float] = (0.0, 0.0)
    # CPU: read tokens, stop checks, detokenize, free pages
    process: tuple[float, float] = (0.0, 0.0)

    @property
    def cpu_seconds(self) -> float:
        return (self.schedule[1] - self.schedule[0]) + (self.process[1] - self.process[0])

    @property
    def device_seconds(self) -> float:
        return self.device[1] - self.device[0]


class DeviceClock:
    """Maps CUDA events onto perf_counter: one reference event recorded and synchronised at a known
    host time."""

    def __init__(self, device: torch.device):
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(torch.cuda.current_stream(device))
        self.ref.synchronize()
        self.t_ref = time.perf_counter()

    def to_host(self, event: torch.cuda.Event) -> float:
        return self.t_ref + self.ref.elapsed_time(event) / 1e3  # elapsed_time is in ms


@dataclass
class Pending:
    """One launched step whose tokens the CPU has not read yet."""

    future: Future | None = None  # the worker's job (None: ran synchronously, `value` is set)
    value: object = None
    timing: StepTiming | None = None
    # inputs the device may still read (CUDA allocator safety)
    keep_alive: list = field(default_factory=list)
    # stage 8: the step's logprob tensors, when a request asked
    logprobs: dict = field(default_factory=dict)

    def wait(self):
        if self.future is not None:
            self.value, self.future = self.future.result(), None
        tokens, done_event, events = self.value
        if done_event is not None:
            # the device finished this step and its tokens reached host memory
            done_event.synchronize()
            tokens = tokens.tolist()
        return tokens, events


class DeviceWorker:
    def __init__(self, device: torch.device, overlap: bool):
        self.device, self.overlap = device, overlap
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.clock = DeviceClock(device) if self.cuda else None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="device") if overlap else None

    def submit(self, fn) -> Pending:
        """fn() -> tokens tensor [S] on the device. Returns at once with overlap; after fn ran
        without."""
        ready = None
        # the inputs were copied on the main thread's stream: the forward stream must wait for them
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        job = lambda: self._run(fn, ready)  # noqa: E731
        if self.executor is None:
            # a failed pass raises where it is read back (wait), with or without overlap
            done: Future = Future()
            try:
                done.set_result(job())
            except Exception as exc:  # noqa: BLE001
                done.set_exception(exc)
            return Pending(future=done)
        return Pending(future=self.executor.submit(job))

    def _run(self, fn, ready):
        if not self.cuda:
            t0 = time.perf_counter()
            # a CPU "device" is synchronous: the step is done when fn returns
            tokens = fn().tolist()
            return tokens, None, (t0, time.perf_counter())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            tokens = fn()  # [S] on the device
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            # lands when the stream gets there; wait() syncs on `end`
            host.copy_(tokens, non_blocking=True)
            end.record(self.stream)
        return host, end, (start, end)

    def times(self, events) -> tuple[float, float]:
        """The device span of a finished step on the host clock."""
        if self.clock is None:
            return events
        return self.clock.to_host(events[0]), self.clock.to_host(events[1])

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
