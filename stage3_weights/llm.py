"""The offline API every stage shares: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import torch

from .core import Req, SamplingParams
from .engine import Engine
from .gguf_loader import gguf_folder
from .tokenizer import Messages, Tokenizer, TokenizerConfig

Prompt = Union[str, list[int]]


@dataclass
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated ids only
    text: str
    # "stop", "length", or "error" (then `error` says why and nothing was generated)
    finish_reason: str
    error: str | None = None

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


class LLM:
    def __init__(self, model: str | Path = "smollm2-135m-instruct", device: str = "cpu",
                 dtype: str | torch.dtype = "float32", attention_backend: str | None = None,
                 max_batch_size: int = 32, tokenizer_config: TokenizerConfig | None = None,
                 progress: bool | None = None, verbose: bool = True):
        """dtype: float32, bfloat16, float16 or "auto" (the checkpoint's). progress: a loading
        progress bar (None: when stderr is a terminal). verbose: print one line on load with the
        memory report."""
        self.model_path = resolve_model_path(model)
        self.tokenizer = Tokenizer(self.model_path, tokenizer_config)
        self.engine = Engine(self.model_path, device=device, dtype=dtype,
                             attention_backend=attention_backend, max_batch_size=max_batch_size,
                             eos_token_ids=self.tokenizer.eos_token_ids, progress=progress,
                             verbose=verbose)
        if self.tokenizer.config.max_length is None:  # leave room for at least one generated token
            self.tokenizer.config.max_length = self.engine.max_context_len - 1
        self._next_rid = 0

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

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 pad_to_longest: bool = False) -> list[GenerateResult]:
        """Generate for all prompts (strings or lists of token ids) in static batches of up to
        max_batch_size.

        A bad prompt or bad SamplingParams fails alone: its result carries `error`, the others still
        run.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        isinstance(prompts[0], int)):
            prompts = [prompts]
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        params_list = _one_params_per_prompt(sampling_params, len(prompts))

        results: list[GenerateResult | None] = [None] * len(prompts)
        reqs, index_of = [], {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                if not isinstance(params, SamplingParams):
                    raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
                params.validate()
                input_ids = self.encode(prompt)
                self.engine.check_prompt_fits(len(input_ids))
            except ValueError as exc:
                results[i] = GenerateResult([], [], "", "error", error=f"prompt {i}: {exc}")
                continue
            req = Req(self._next_rid, input_ids, params)
            self._next_rid += 1
            reqs.append(req)
            index_of[req.rid] = i

        self.engine.generate(reqs, pad_to_longest)
        for req in reqs:
            text = self.tokenizer.decode(req.output_ids)
            results[index_of[req.rid]] = GenerateResult(req.input_ids, req.output_ids, text,
                                                        req.finish_reason)
        return results


def _one_params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
