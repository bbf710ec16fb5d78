"""Tensor parallelism's plumbing: process groups, the collectives the model needs, and launching the
ranks.

    rank 0                          the caller's process: the LLM, its scheduler, and shard 0 of the
                                    model
    ranks 1 .. tp_size-1            spawned processes (or, with --nnodes, started on other
                                    machines), each with its own shard, the same scheduler, and a
                                    loop that steps it (llm.py, run_follower)

Two process groups, because two threads of every rank talk to the others:
- the *model* group (NCCL on CUDA, gloo on a CPU): the all-reduces and all-gathers of the forward
  pass, issued by the device worker (stage 5) one step after another, in the same order on every
  rank;
- the *control* group (always gloo, on the CPU): rank 0's scheduler commands (new requests, aborts,
  cache flushes, shutdown), broadcast at the start of every step from the main thread, and the
  optional divergence guard's gather after it. On one group the two threads' collectives could
  interleave differently on different ranks, and every rank would wait for a message another rank
  never sends.

Failures must not hang: a rank that raises sends its traceback to rank 0 and exits; a rank that dies
breaks its sockets, so the others' next collective fails at once (a timeout bounds the rest), and
rank 0 reports which rank died and why.
"""

from __future__ import annotations

import datetime
import inspect
import os
import queue
import socket
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

# the longest a rank waits for a peer that went silent
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# Waiting for rank 0's next command is not a failure: an idle server sends none for hours. (If rank
# 0 dies, its sockets close and the wait fails at once.)
COMMAND_TIMEOUT = datetime.timedelta(days=7)
COMM = Counter()  # calls and bytes per collective on this rank (the notebook shows them)


@dataclass(frozen=True)
class TPInfo:
    """Which shard this process holds. size 1 (the default): no parallelism, no collective is ever
    called."""

    rank: int = 0
    size: int = 1
    group: object = None  # the model's torch.distributed ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (after a row-parallel matmul: each rank has a partial
        sum)."""
        if self.size > 1:
            COMM["all_reduce calls"] += 1
            COMM["all_reduce bytes"] += x.numel() * x.element_size()
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, n] on each rank -> [B, size * n], rank r's columns at r * n (the parallel LM head's
        logits)."""
        if self.size == 1:
            return x
        COMM["all_gather calls"] += 1
        COMM["all_gather bytes"] += x.numel() * x.element_size() * self.size
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        # torch >= 2.13 / older
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        # [size, B, n] -> [B, size * n]
        return out.view(self.size, *x.shape).movedim(0, -2).flatten(-2)


SINGLE = TPInfo()


def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 64) -> list[int]:
    """tp sizes that split the heads: query heads evenly, and KV heads either evenly or replicated
    (tp a multiple of the KV head count, each KV head then on tp / num_kv_heads ranks)."""
    return [
        n for n in range(1, limit + 1)
        if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_groups(rank: int, world_size: int, dist_init_addr: str, device: torch.device,
                        check_ranks=None, shared_device: bool = False):
    """Join the ranks (blocks until all world_size have joined) -> (TPInfo of the model group,
    control group). shared_device: the ranks share one GPU (--gpu-id-step 0), which NCCL refuses
    (one rank per GPU): the model group is gloo, on the GPU's tensors.

    Rank 0 hosts the rendezvous store at dist_init_addr and waits there until every rank has checked
    in, calling check_ranks() (which raises if a rank it spawned has already died) as it waits: a
    rank that fails while starting ends the wait at once instead of after COLLECTIVE_TIMEOUT."""
    host, port = dist_init_addr.rsplit(":", 1)
    if host in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
        # all ranks on this machine: talk over loopback only
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0,
                          timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    joined = store.add("ranks_joined", 1)
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while rank == 0 and joined < world_size:
        if check_ranks is not None:
            check_ranks()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {joined} of {world_size} tensor-parallel ranks joined at {dist_init_addr} "
                f"within {COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)
        joined = store.add("ranks_joined", 0)
    backend = "nccl" if device.type == "cuda" and not shared_device else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return TPInfo(rank, world_size, dist.group.WORLD), control


def check_not_importing_main(what: str) -> None:
    """A spawned rank starts by running the script that started it again, as module `__mp_main__`
    (multiprocessing's "spawn"; CUDA needs it). A script that creates the LLM at its top level would
    make every rank create one, and start ranks of its own. Say what to change, as vLLM and PyTorch
    do, instead of failing somewhere deep in multiprocessing. (Only a spawned process runs a module
    named __mp_main__.)"""
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals.get("__name__") == "__mp_main__"):
        frame = frame.f_back
    if frame is None:
        return
    script = frame.f_globals.get("__file__", "the main script")
    raise RuntimeError(
        f"{what} was called while a tensor-parallel rank was starting: each rank is a new process "
        "that first runs "
        f"{script} again, and that script creates the LLM when it is run, not only when it is the "
        "main program. "
        f"Create it under `if __name__ == \"__main__\":` (line {frame.f_lineno} of {script} is "
        "not), e.g.\n\n"
        f"    def main():\n        llm = LLM(..., tp_size=2)\n        ...\n\n"
        f"    if __name__ == \"__main__\":\n        main()\n"
    )


def broadcast_object(obj, control_group):
    """Rank 0's obj, on every rank (pickled over the control group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group)
    return box[0]


def check_in_sync(step: int, record, control_group) -> None:
    """The divergence guard (enable_tp_sync_check): gather every rank's record of this step (the
    batch it built, the tokens it sampled) and raise, on every rank, if any differs from rank 0's.
    Ranks that disagree would otherwise go on until their collectives no longer match: a size error
    over gloo, a hang or silent corruption over NCCL. SGLang's closest knob,
    SYNC_TOKEN_IDS_ACROSS_TP, all-reduces the token ids so that ranks agree; this one reports the
    first step where they did not."""
    records: list = [None] * dist.get_world_size(control_group)
    dist.all_gather_object(records, record, group=control_group)
    problem = describe_divergence(step, records)
    if problem is not None:
        raise TPDivergenceError(problem)


def describe_divergence(step: int, records: list) -> str | None:
    """records[r] = rank r's (batch, tokens) of one step -> None if all equal, else which ranks
    differ and how."""
    differ = [r for r in range(1, len(records)) if records[r] != records[0]]
    if not differ:
        return None
    lines = [
        f"tensor-parallel ranks diverged at scheduler step {step}: rank(s) {differ} differ from "
        "rank 0"
    ]
    for part, name in ((0, "batch (phase, [(rid, cached_len, extend_len)])"),
                       (1, "sampled [(rid, token ids)]")):
        for r in differ:
            if records[r][part] != records[0][part]:
                lines.append(f"  {name}: rank 0 {records[0][part]}, rank {r} {records[r][part]}")
    return "\n".join(lines)


def min_over_ranks(value: int, control_group) -> int:
    """The smallest of every rank's value: ranks whose devices differ must still agree on one KV
    pool size."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)
    return int(t.item())


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class RankFailure:
    rank: int
    message: str  # the rank's traceback, or how its process ended

    @property
    def lost_connection(self) -> bool:
        """It failed because another rank went away (a consequence, not the cause)."""
        return (
            "Connection closed by peer" in self.message
            or "Connection reset by peer" in self.message
        )


class LocalRanks:
    """The ranks this process spawned: start them, hear from them, stop them, and say which one
    failed."""

    def __init__(self, target, ranks: list[int], args: tuple):
        # a fresh interpreter: no inherited threads or CUDA state
        ctx = torch.multiprocessing.get_context("spawn")
        self.errors = ctx.Queue()  # (rank, traceback) from ranks that raised
        self.reported: dict[int, str] = {}
        self.procs = {
            r: ctx.Process(target=run_rank, args=(target, r, self.errors, *args), daemon=True,
                           name=f"tp-rank-{r}")
            for r in ranks
        }
        for p in self.procs.values():
            p.start()

    def check_started(self) -> None:
        """Raise if a rank's process has ended while rank 0 still waits for every rank to join."""
        ended = [r for r, p in self.procs.items() if p.exitcode is not None]
        if ended:
            raise TPError(f"tensor-parallel rank(s) {ended} ended while starting")

    def failures(self, wait: float = 5.0) -> list[RankFailure]:
        """The ranks that failed, with why. A collective can fail a moment before the peer's death
        is visible (its socket closes as it dies): wait up to `wait` seconds for some evidence."""
        deadline = time.monotonic() + wait
        while not self._failures() and time.monotonic() < deadline and self.procs:
            time.sleep(0.05)
        time.sleep(0.5)  # one failure brings down the others' collectives: let them all report
        return self._failures()

    def _failures(self) -> list[RankFailure]:
        # a multiprocessing queue's empty() can lie while its feeder thread writes: poll with get
        while True:
            try:
                rank, message = self.errors.get(timeout=0.05)
            except queue.Empty:
                break
            self.reported[rank] = message
        found = {rank: RankFailure(rank, message) for rank, message in self.reported.items()}
        for rank, p in self.procs.items():
            if rank not in found and p.exitcode not in (None, 0):
                how = (f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else
                       f"exited with status {p.exitcode} (what it printed on stderr says why)")
                found[rank] = RankFailure(rank, f"its process {how}")
        return sorted(found.values(), key=lambda f: (f.lost_connection, f.rank))  # the cause first

    def join(self, timeout: float | None = None) -> None:
        for p in self.procs.values():
            p.join(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Wait for the ranks to end (they were told to), terminate the ones that do not."""
        self.join(timeout)
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.errors.close()
        self.errors.join_thread()


def run_rank(target, rank: int, errors, *args) -> None:
    """A spawned rank: run target(rank, *args); on an exception, tell rank 0 and exit at once (a
    dead process breaks its sockets, so the other ranks' collectives fail instead of waiting)."""
    try:
        target(rank, *args)
    except BaseException:  # noqa: BLE001 — whatever happened, rank 0 must hear of it
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        os._exit(1)


class TPError(RuntimeError):
    """A tensor-parallel rank failed; the message names it and carries its traceback."""


class TPDivergenceError(TPError):
    """The ranks built different batches or sampled different tokens (check_in_sync)."""


def describe(failures: list[RankFailure], cause: BaseException | None = None) -> str:
    """The error rank 0 raises: the failed rank(s) first, with their traceback; ranks that only lost
    the connection to them in one line."""
    causes = [f for f in failures if not f.lost_connection]
    lost = [f.rank for f in failures if f.lost_connection]
    if not causes:
        where = f"ranks {lost} lost their connection; " if lost else ""
        return (
            f"a tensor-parallel rank on another machine (or its connection) failed: {where}{cause}"
        )
    text = "\n".join(f"tensor-parallel rank {f.rank} failed: {f.message}" for f in causes)
    return text + (f"\n(ranks {lost} then lost their connection to it)" if lost else "")
