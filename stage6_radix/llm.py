"""The offline API every stage shares, now built on the scheduler's add_request / step loop.

    llm.generate(prompts, params)        -> one GenerateResult per prompt (runs the loop until all
                                         are done)
    llm.stream(prompts, params)          -> yields StreamChunk text deltas as tokens are produced
    llm.add_request(...) / llm.step()    -> the loop itself, for requests that arrive while others
                                         run
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch

from .beam_search import BeamSearchResult, beam_search
from .core import Req, SamplingParams
from .engine import Engine
from .gguf_loader import gguf_folder
from .scheduler import Scheduler, StepOutput
from .server_args import ServerArgs
from .tokenizer import Messages, Tokenizer, TokenizerConfig

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

        With overlap on, the LLM owns a device-worker thread: `close()` (or `with LLM(...) as llm:`)
        stops it; an LLM that is garbage-collected, or still open when the interpreter exits, is
        closed then."""
        self.server_args = args = ServerArgs.from_kwargs(model_path=model, device=device,
                                                         dtype=dtype, **options)
        self.model_path = resolve_model_path(args.model_path)
        self.tokenizer = Tokenizer(self.model_path, tokenizer_config)
        self.engine = Engine(
            self.model_path, device=args.device, dtype=args.dtype,
            attention_backend=args.attention_backend, page_size=args.page_size,
            max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            eos_token_ids=self.tokenizer.eos_token_ids, progress=args.progress, verbose=verbose,
            cuda_graph=not args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
            enable_torch_compile=args.enable_torch_compile,
            torch_compile_max_bs=args.torch_compile_max_bs)
        if self.tokenizer.config.max_length is None:  # leave room for at least one generated token
            self.tokenizer.config.max_length = self.engine.max_context_len - 1
        self.scheduler = Scheduler(
            self.engine, self.tokenizer, max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_conservativeness=args.schedule_conservativeness,
            log_interval=args.log_interval, record_stats=args.record_stats, overlap=None
            if args.disable_overlap is None else not args.disable_overlap,
            disable_radix_cache=args.disable_radix_cache, schedule_policy=args.schedule_policy)
        # Runs once: at close(), when the LLM is garbage-collected, or at interpreter exit
        # (weakref.finalize).
        self._closer = weakref.finalize(self, self.scheduler.shutdown)
        self._next_rid = 0

    @classmethod
    def from_server_args(cls, server_args: ServerArgs, **kwargs) -> "LLM":
        """The LLM of a ServerArgs built already (the command line's). kwargs: tokenizer_config,
        verbose."""
        options = {f.name: getattr(server_args, f.name) for f in fields(server_args)}
        return cls(options.pop("model_path"), **options, **kwargs)

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
        req = make_req(self._next_rid, self.encode(prompt), params, priority=priority)
        self.scheduler.add_request(req)
        self._next_rid += 1
        return req

    def step(self) -> list[StepOutput]:
        """One forward pass of the engine; what each touched request produced."""
        if self.closed:
            raise RuntimeError(
                "this LLM was closed (close() or the end of its `with` block): it cannot step")
        return self.scheduler.step()

    def abort_request(self, rid: int) -> None:
        """Stop a request now: it finishes with reason "abort" and gives its pages back."""
        self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Read back the step in flight and stop the device-worker thread. The LLM cannot step
        afterwards."""
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
                                          out.finish_reason, req=out.req)
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
