"""What every tensor-parallel rank runs: its shard of the engine, the same scheduler, stepped in
lockstep.

SGLang's shape: every rank runs its own copy of the (deterministic) scheduler. Rank 0 owns the
requests (it is the LLM's process): every control operation (add a request, abort one, flush the
cache) is recorded, in call order, in one list; at the start of every step rank 0 broadcasts the
list, and every rank, rank 0 included, applies it in that order before it steps. Then every rank
takes the same scheduling decisions on the same state, launches the same batch on its shard, and the
collectives inside the forward pass meet. Every rank samples the same token from the same
(all-gathered) logits. Only rank 0 hands results to the caller.

    rank 0 (LLM.step)                          rank r > 0 (run_follower)
    broadcast Command(ops)  --------------->   cmd = broadcast()
    cmd.apply(scheduler)                       cmd.apply(scheduler)     the same ops, in the same
                                               order
    scheduler.step()  <== all-reduces ==>      scheduler.step()
    -> outputs to the caller                   (its outputs are dropped: they are rank 0's too)

Applying an operation when it is called on rank 0 and later on the others would let the order
differ: a flush then an abort keeps the aborted request's pages in rank 0's tree and drops them from
the others', the next prompt with that prefix is matched differently, and the ranks' batches no
longer have the same shape. At tp 1 the same list is applied at the same point: one code path.

Structured outputs (stage 8) keep this shape: every rank compiles the request's grammar and runs its
own matcher; the same logits give the same mask and the same token on every rank, so no token is
broadcast. Only the moment a compile finishes differs between ranks, and the ranks agree on it
(scheduler/grammar.py).

The alternative shape (rank 0 schedules alone and broadcasts each batch) sends more bytes every step
and leaves the other ranks unable to run the overlap scheduler or the radix cache on their own;
keeping the scheduler deterministic is the price of this one (no wall-clock decisions, the same pool
size on every rank, the same random seeds: a request that samples without a seed gets one drawn on
rank 0).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch
import torch.distributed as dist

from .core import Req
from .distributed import (SINGLE, LocalRanks, TPError, TPInfo, broadcast_object, check_in_sync,
                          describe, destroy, init_process_groups, max_over_ranks,
                          union_over_ranks)
from .engine import Engine, check_device
from .scheduler import Scheduler
from .server_args import ServerArgs
from .tokenizer import Tokenizer, TokenizerConfig


@dataclass
class RankSpec:
    """Everything a rank needs to build its part of the engine (sent to the spawned ranks, so:
    picklable)."""

    model_path: Path  # resolved: every rank loads the same folder
    tokenizer_config: TokenizerConfig | None
    server_args: ServerArgs  # every option (the device is per rank: see device_for)

    @property
    def tp_size(self) -> int:
        return self.server_args.tp_size

    @property
    def ranks_per_node(self) -> int:
        return self.server_args.tp_size // self.server_args.nnodes

    @property
    def shares_device(self) -> bool:
        """--gpu-id-step 0 with tp_size > 1 on CUDA: every rank of a node on one GPU."""
        args = self.server_args
        return args.gpu_id_step == 0 and self.tp_size > 1 and args.device.startswith("cuda")

    def device_for(self, rank: int) -> str:
        # an unknown or missing device is named here, on rank 0
        device = check_device(self.server_args.device)
        if device.type != "cuda" or self.tp_size == 1:
            return str(device)
        # SGLang's placement: GPU (rank on this node) * gpu_id_step; 1 by default: one GPU per rank
        index = (rank % self.ranks_per_node) * self.server_args.gpu_id_step
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"tp_size {self.tp_size} puts rank {rank} on cuda:{index}, but this machine has "
                f"{torch.cuda.device_count()} CUDA GPU(s); --gpu-id-step 0 runs every rank on one "
                "GPU (gloo between them, no CUDA graphs: a rehearsal, not a speed-up)")
        return f"cuda:{index}"


@dataclass
class AddRequest:
    req: Req  # pickled when broadcast: every other rank gets it as it was when added

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.add_request(self.req)


@dataclass
class AbortRequest:
    rid: int

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.abort(self.rid)


@dataclass
class FlushCache:
    def apply(self, scheduler: Scheduler) -> None:
        scheduler.flush_cache()


ControlOp = Union[AddRequest, AbortRequest, FlushCache]


@dataclass
class Command:
    """What rank 0 tells every rank at the start of a step: the control operations since the last
    step, in the order they were called. Every rank, rank 0 included, applies them in that order,
    then steps."""

    ops: list[ControlOp] = field(default_factory=list)
    report: bool = False  # gather every rank's memory report instead of stepping
    shutdown: bool = False

    def apply(self, scheduler: Scheduler) -> None:
        for op in self.ops:
            op.apply(scheduler)


def build_rank(spec: RankSpec, rank: int, tp: TPInfo = SINGLE, control=None, verbose: bool = True):
    """-> (tokenizer, engine, scheduler) of one rank. Every rank builds the same way, in the same
    order: the engine's constructor meets the other ranks once (to agree on the KV pool's size)."""
    args = spec.server_args
    tokenizer = Tokenizer(spec.model_path, spec.tokenizer_config)
    engine = Engine(
        spec.model_path, device=spec.device_for(rank), dtype=args.dtype,
        attention_backend=args.attention_backend, page_size=args.page_size,
        max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, eos_token_ids=tokenizer.eos_token_ids,
        progress=args.progress, verbose=verbose,
        # ranks sharing a GPU all-reduce over gloo, which a CUDA graph cannot capture
        cuda_graph=not (args.disable_cuda_graph or spec.shares_device),
        cuda_graph_max_bs=args.cuda_graph_max_bs, load_format=args.load_format,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs, tp=tp, control_group=control)
    if tokenizer.config.max_length is None:  # leave room for at least one generated token
        tokenizer.config.max_length = engine.max_context_len - 1
    # Ranks 1+ hand no text to anyone: they detokenize only what stop strings need.
    scheduler = Scheduler(
        engine, tokenizer, max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_conservativeness=args.schedule_conservativeness, log_interval=args.log_interval,
        record_stats=args.record_stats, overlap=None if args.disable_overlap is None else
        not args.disable_overlap, disable_radix_cache=args.disable_radix_cache,
        schedule_policy=args.schedule_policy, stream_text=rank == 0,
        grammar_compile_timeout=args.grammar_compile_timeout)
    if args.enable_tp_sync_check and tp.size > 1:
        scheduler.tp_sync_check = functools.partial(check_in_sync, control_group=control)
    # the ranks admit a request with a grammar at the same step (scheduler/grammar.py), and drop
    # a failed request at the same step (Scheduler.fail_requests)
    if tp.size > 1:
        scheduler.grammars.sync = functools.partial(max_over_ranks, control_group=control)
        scheduler.failure_sync = functools.partial(union_over_ranks, control_group=control)
    return tokenizer, engine, scheduler


def start_ranks(spec: RankSpec, dist_init_addr: str) -> tuple[TPInfo, object, LocalRanks]:
    """On node 0: spawn ranks 1 .. ranks_per_node-1 of this node, join the process groups as rank
    0."""
    for rank in range(spec.ranks_per_node):  # a GPU this node lacks is refused before any spawn
        spec.device_for(rank)
    ranks = LocalRanks(run_follower, list(range(1, spec.ranks_per_node)), (spec, dist_init_addr))
    try:
        tp, control = init_process_groups(0, spec.tp_size, dist_init_addr,
                                          torch.device(spec.device_for(0)),
                                          check_ranks=ranks.check_started,
                                          shared_device=spec.shares_device)
    except Exception as exc:
        failures = ranks.failures()
        ranks.stop(timeout=1)
        raise TPError(describe(failures, exc)) from exc
    return tp, control, ranks


def serve_node(spec: RankSpec, node_rank: int, dist_init_addr: str) -> None:
    """On node N > 0 (`python -m stage8_server --node-rank N`): run this node's ranks until rank 0
    shuts them down."""
    first = node_rank * spec.ranks_per_node
    ranks = LocalRanks(run_follower, list(range(first, first + spec.ranks_per_node)),
                       (spec, dist_init_addr))
    ranks.join()  # until rank 0 tells them to stop, or one fails
    failures = ranks.failures(wait=0)
    ranks.stop()
    if failures:
        raise TPError(describe(failures))


def run_follower(rank: int, spec: RankSpec, dist_init_addr: str) -> None:
    """A rank other than 0: build its shard, then follow rank 0's commands until told to stop."""
    # the node's cores, shared
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.ranks_per_node))
    tp, control = init_process_groups(rank, spec.tp_size, dist_init_addr,
                                      torch.device(spec.device_for(rank)),
                                      shared_device=spec.shares_device)
    _, engine, scheduler = build_rank(spec, rank, tp, control, verbose=False)
    try:
        while True:
            cmd = broadcast_object(None, control)
            if cmd.shutdown:
                break
            if cmd.report:
                dist.gather_object(rank_report(engine), None, dst=0, group=control)
                continue
            cmd.apply(scheduler)
            scheduler.step()
    finally:
        scheduler.shutdown()
        destroy()


def rank_report(engine: Engine) -> dict:
    """This rank's memory: weights (and the part replicated on every rank) and its KV pool."""
    report = engine.memory_report()
    pool = engine.kv_pool
    return {
        "rank": engine.tp.rank, "weight_bytes": report.param_bytes,
        "replicated_bytes": report.replicated_bytes,
        "checkpoint_bytes_read": engine.load_stats.bytes_read, "kv_heads": engine.num_kv_heads,
        "kv_bytes_per_token": report.kv_bytes_per_token, "kv_pool_bytes": pool.k.numel() *
        pool.k.element_size() * 2, "kv_tokens": pool.num_pages * pool.page_size
    }


def shutdown_ranks(scheduler: Scheduler, control, ranks: LocalRanks | None) -> None:
    """Rank 0's close: stop every rank (they may already be gone), then this process's worker."""
    if control is not None:
        try:
            broadcast_object(Command(shutdown=True), control)
        # noqa: BLE001 — a rank that died cannot be told to stop; it is stopped below
        except Exception:
            pass
    try:
        scheduler.shutdown()
    # noqa: BLE001 — the step in flight failed with its rank (already reported): nothing to read
    except Exception:
        if control is None:
            raise
    finally:
        if ranks is not None:
            ranks.stop()
        destroy()


def abandon_ranks(ranks: LocalRanks | None) -> None:
    """Rank 0 failed before the ranks could be told anything: stop them by force."""
    if ranks is not None:
        ranks.stop(timeout=0)
    destroy()
