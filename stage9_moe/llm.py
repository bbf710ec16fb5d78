"""The offline API every stage shares, now built on the scheduler's add_request / step loop.

    llm.generate(prompts, params)        -> one GenerateResult per prompt (runs the loop until all
                                         are done)
    llm.stream(prompts, params)          -> yields StreamChunk text deltas as tokens are produced
    llm.add_request(...) / llm.step()    -> the loop itself, for requests that arrive while others
                                         run
"""

from __future__ import annotations

import json
import random
import weakref
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch
import torch.distributed as dist

from .beam_search import BeamSearchResult, beam_search
from .constrained import check_grammar
from .core import Req, SamplingParams
from .distributed import (
    SINGLE,
    TPError,
    broadcast_object,
    check_not_importing_main,
    describe,
    free_port,
)
from .engine import check_device
from .gguf_loader import gguf_folder
from .models import ModelConfig, check_tp_size
from .scheduler import StepOutput
from .server_args import ServerArgs
from .tokenizer import Messages, TokenizerConfig
from . import tp_worker
from .tp_worker import (AbortRequest, AddRequest, Command, FlushCache, RankSpec, abandon_ranks,
                        build_rank, rank_report, shutdown_ranks, start_ranks)

Prompt = Union[str, list[int]]


@dataclass
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated ids only
    text: str
    # "stop", "length", "abort", or "error" (then `error` says why; nothing was generated)
    finish_reason: str
    error: str | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    # prompt tokens served from the prefix cache (their K/V were not computed again)
    cached_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def resolve_model_path(model: str | Path) -> Path:
    """A local Hugging Face folder is used as is; a .gguf file through the folder of its metadata
    (gguf_loader.py); a short name ("smollm2-135m-instruct") is fetched
    once into a cache by the course's support code, the one place a stage calls into `common/`."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():  # one file: its metadata unpacked to a folder
        return gguf_folder(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(
                f"model folder {path} has no config.json: not a Hugging Face checkpoint")
        return path
    if path.exists() or "/" in str(model) or "\\" in str(model):
        raise ValueError(f"model path {model!r} does not exist or is not a folder")
    try:
        from common.models import resolve_model
    except ImportError as exc:  # the stage was copied out of the course repo
        raise ValueError(f"unknown model {model!r}: pass a local Hugging Face folder") from exc
    return resolve_model(model)


@dataclass
class StreamChunk:
    index: int  # which prompt of the call
    text: str  # new text since the last chunk of this prompt (never a broken UTF-8 character)
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    req: Req | None = None  # the request itself, for its final state


class LLM:
    def __init__(self, model: str | Path = ServerArgs.model_path, device: str = "cpu",
                 dtype: str | torch.dtype = "float32", *,
                 tokenizer_config: TokenizerConfig | None = None, verbose: bool = True, **options):
        """model, device, dtype and every other option (page_size=..., max_running_requests=...):
        the fields of ServerArgs (server_args.py holds their defaults, help and checks); an unknown
        one is a TypeError naming it. verbose: print one line on load with the memory report and the
        KV pool's size.

        Stage 7: tp_size > 1 splits the model over that many ranks: this process is rank 0, the
        others are spawned (a script doing this must create the LLM under `if __name__ ==
        "__main__":`, as with any spawned process). With nnodes > 1 this process and tp_size /
        nnodes ranks run on this machine (node 0); each other node runs `python -m <stage>
        --node-rank N` with the same flags. dist_init_addr ("host:port", where rank 0 listens) is
        needed then; on one node a free local port is picked. load_format "dummy": random weights.
        enable_tp_sync_check: after every step, compare the batch each rank built and the tokens it
        sampled, and raise TPDivergenceError naming the step and the ranks that differ (one gather
        over the control group per step: a debugging guard, off by default).

        With overlap on, the LLM owns a device-worker thread: `close()` (or `with LLM(...) as llm:`)
        stops it, and the other ranks; an LLM that is garbage-collected, or still open when the
        interpreter exits, is closed then."""
        self.server_args = args = ServerArgs.from_kwargs(model_path=model, device=device,
                                                         dtype=dtype, **options)
        if args.node_rank != 0:
            raise ValueError(
                f"node_rank={args.node_rank}: the LLM runs on node 0; another node serves its "
                "ranks "
                f"with serve_node (python -m {__package__} --node-rank N)"
            )
        if args.tp_size > 1:
            check_not_importing_main(f"LLM(tp_size={args.tp_size})")
        self.model_path = resolve_model_path(args.model_path)
        spec = RankSpec(self.model_path, tokenizer_config, args)
        self.tp_size, self._control, self._ranks, tp = args.tp_size, None, None, SINGLE
        if args.tp_size > 1:
            config = ModelConfig.from_hf(json.loads((self.model_path / "config.json").read_text()))
            check_tp_size(config, args.tp_size)  # before any rank is started
            if args.device != "cpu":
                # every rank of this node needs its GPU
                check_device(spec.device_for(spec.ranks_per_node - 1))
            tp, self._control, self._ranks = start_ranks(
                spec, args.dist_init_addr or f"127.0.0.1:{free_port()}")
        # the control operations of this turn, applied by every rank at the next step
        self._pending = Command()
        try:
            self.tokenizer, self.engine, self.scheduler = self._collective(
                lambda: build_rank(spec, 0, tp, self._control, verbose))
        except BaseException:
            # they may be waiting for rank 0 in any collective: stop them
            abandon_ranks(self._ranks)
            raise
        # Runs once: at close(), when the LLM is garbage-collected, or at interpreter exit
        # (weakref.finalize).
        self._closer = weakref.finalize(self, shutdown_ranks, self.scheduler, self._control,
                                        self._ranks)
        self._next_rid = 0

    @classmethod
    def from_server_args(cls, server_args: ServerArgs, **kwargs) -> "LLM":
        """The LLM of a ServerArgs built already (the command line's). kwargs: tokenizer_config,
        verbose."""
        options = {f.name: getattr(server_args, f.name) for f in fields(server_args)}
        return cls(options.pop("model_path"), **options, **kwargs)

    def _collective(self, fn):
        """Run fn (which meets the other ranks); if a rank failed, say which, with its traceback."""
        try:
            return fn()
        except TPError:  # already names the ranks (the divergence guard)
            raise
        except Exception as exc:
            if self._ranks is None and self._control is None:
                raise
            failures = self._ranks.failures() if self._ranks else []
            raise TPError(describe(failures, exc)) from exc

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt token list is empty: nothing to continue from")
        vocab = self.engine.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return self.tokenizer.truncate(ids)

    def apply_chat_template(self, messages: Messages) -> list[int]:
        """A user message (str) or a list of {"role", "content"} messages -> prompt token ids."""
        return self.tokenizer.apply_chat_template(messages)

    # ---------------------------------------------------------------- the loop, exposed
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> int:
        """Queue one request; returns its id. A bad request raises ValueError and leaves the engine
        untouched."""
        return self._add(prompt, sampling_params, priority).rid

    def _add(self, prompt: Prompt, sampling_params: SamplingParams | None, priority: int,
             make_req=Req) -> Req:
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        # a grammar that does not parse is refused now, by name (the server does it too)
        check_grammar(params)
        req = make_req(self._next_rid, self.encode(prompt), params, priority=priority)
        self.add_req(req)
        self._next_rid += 1
        return req

    def add_req(self, req: Req) -> None:
        """Queue a request its caller built (stage 8's server picks its own rids and sets Req fields
        such as return_logprob). A bad request raises ValueError and leaves the engine untouched."""
        params = req.sampling_params
        if self.tp_size > 1 and params.seed is None and not params.is_greedy:
            # every rank must draw the same token
            req.sampling_params = replace(params, seed=random.getrandbits(63))
        # refused now, by name; accepted, it joins at the next step
        self.scheduler.check_request(req)
        self._pending.ops.append(AddRequest(req))

    def step(self) -> list[StepOutput]:
        """One forward pass of the engine; what each touched request produced. First every rank
        applies this turn's control operations (adds, aborts, flushes) in the order they were
        called: with tensor parallelism rank 0 broadcasts them, then all step together."""
        if self.closed:
            raise RuntimeError(
                "this LLM was closed (close() or the end of its `with` block): it cannot step")
        cmd, self._pending = self._pending, Command()

        def apply_and_step() -> list[StepOutput]:
            if self._control is not None:
                broadcast_object(cmd, self._control)
            cmd.apply(self.scheduler)
            return self.scheduler.step()
        return self._collective(apply_and_step)

    def abort_request(self, rid: int) -> None:
        """Stop a request at the next step: it finishes with reason "abort" and gives its pages
        back. (An unknown or finished rid is ignored.)"""
        self._pending.ops.append(AbortRequest(rid))

    def flush_cache(self) -> None:
        """At the next step, empty the prefix cache of everything no running request uses (on every
        rank)."""
        self._pending.ops.append(FlushCache())

    def has_request(self, rid: int) -> bool:
        """Unfinished: queued, running, or added this turn."""
        return rid in self.scheduler.reqs or any(isinstance(op, AddRequest) and op.req.rid == rid
                                                 for op in self._pending.ops)

    @property
    def has_pending_ops(self) -> bool:
        """Control operations wait for the next step to be applied."""
        return bool(self._pending.ops)

    def rank_reports(self) -> list[dict]:
        """Every rank's memory (weights, replicated part, KV pool), rank 0 first."""
        if self._control is None:
            return [rank_report(self.engine)]
        reports: list = [None] * self.tp_size

        def gather():
            broadcast_object(Command(report=True), self._control)
            dist.gather_object(rank_report(self.engine), reports, dst=0, group=self._control)
        self._collective(gather)
        return reports

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or any(
            isinstance(op, AddRequest) for op in self._pending.ops)

    def close(self) -> None:
        """Read back the step in flight, stop the device-worker thread and the other ranks. The LLM
        cannot step afterwards."""
        self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- offline conveniences
    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               priorities: Sequence[int] | None = None) -> Iterator[StreamChunk]:
        """Yield text deltas as they are produced. A bad request yields one chunk with reason
        "error". A consumer that stops early (break, or close() on the generator) aborts the
        requests still running, so their pages go back to the pool instead of decoding for
        nobody."""
        prompts = _as_prompt_list(prompts)
        params_list = _one_params_per_prompt(sampling_params, len(prompts))
        index_of: dict[int, int] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                try:
                    req = self._add(prompt, params, priorities[i] if priorities else 0)
                except ValueError as exc:
                    yield StreamChunk(i, "", [], True, "error", error=f"prompt {i}: {exc}")
                    continue
                index_of[req.rid] = i
            while index_of:
                for out in self.step():
                    i = index_of.get(out.rid)
                    if i is not None:
                        if out.finished:
                            del index_of[out.rid]
                        yield StreamChunk(i, out.text_delta, out.new_token_ids, out.finished,
                                          out.finish_reason, error=out.error, req=out.req)
        # normal end: nothing left; GeneratorExit or an error: abort what this call started
        finally:
            for rid in index_of:
                self.abort_request(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Sequence[int] | None = None) -> list[GenerateResult]:
        """Generate for all prompts with continuous batching. A bad prompt or bad SamplingParams
        fails alone: its result carries `error`, the others still run."""
        prompts = _as_prompt_list(prompts)
        texts = [""] * len(prompts)
        results: list[GenerateResult | None] = [None] * len(prompts)
        for chunk in self.stream(prompts, sampling_params, priorities):
            texts[chunk.index] += chunk.text
            if chunk.error:
                results[chunk.index] = GenerateResult([], [], "", "error", error=chunk.error)
            elif chunk.finished:
                req = chunk.req
                results[chunk.index] = GenerateResult(
                    req.input_ids, req.output_ids, texts[chunk.index], req.finish_reason,
                    matched_stop=req.matched_stop, cached_tokens=req.cached_tokens)
        return results

    def beam_search(self, prompts: Prompt | Sequence[Prompt], beam_width: int,
                    max_new_tokens: int, length_penalty: float = 1.0,
                    early_stopping: bool | str = False,
                    stop_token_ids: Sequence[int] = ()) -> list[BeamSearchResult]:
        """The beam_width most likely continuations of each prompt (Hugging Face's beam search:
        length_penalty, early_stopping True / False / "never"; EOS and stop_token_ids end a
        hypothesis). The beams of a prompt share their prefix pages through the radix cache
        (beam_search.py). One BeamSearchResult per prompt, its hypotheses best first."""
        return beam_search(self, _as_prompt_list(prompts), beam_width, max_new_tokens,
                           length_penalty, early_stopping, stop_token_ids)


def serve_node(server_args: ServerArgs, tokenizer_config: TokenizerConfig | None = None) -> None:
    """Run node server_args.node_rank (> 0) of a multi-node tensor-parallel engine: its tp_size /
    nnodes ranks, until rank 0 (the LLM on node 0, with the same options) shuts them down. `python
    -m <stage> --node-rank N` calls this."""
    if server_args.node_rank == 0:
        raise ValueError(
            f"node_rank must be in [1, {server_args.nnodes}) here; node 0 runs the LLM itself")
    spec = RankSpec(resolve_model_path(server_args.model_path), tokenizer_config, server_args)
    tp_worker.serve_node(spec, server_args.node_rank, server_args.dist_init_addr)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                    isinstance(prompts[0], int)):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    return list(prompts)


def _one_params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
