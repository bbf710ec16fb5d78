"""Every option of the engine in one dataclass, under SGLang's names
(python/sglang/srt/server_args.py).

Each field holds an option's default, its help text (the field's metadata) and, in check(), what it
may be. The Python API and the command line are two doors to the same object:

    LLM(model, page_size=4)   ->  ServerArgs(model_path=model, page_size=4)
    --page-size 4             ->  ServerArgs.add_cli_args(parser), then
                                  ServerArgs.from_cli_args(args)

The flag of a field is its name in kebab case (max_running_requests -> --max-running-requests).
Every value is checked when the ServerArgs is built, before any weight is loaded, and an error names
the option.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field

import torch

from .attention import BACKENDS

DTYPES = ("float32", "bfloat16", "float16", "auto")
# On a CPU a token costs less in a larger prefill step (larger matmuls), and a prompt cut in fewer
# chunks puts fewer small decode steps between them (stage 4 README, 4.4).
CPU_CHUNKED_PREFILL_SIZE, CUDA_CHUNKED_PREFILL_SIZE = 2048, 512


def option(default, help: str, **cli):
    """A field with its help text. cli: choices=(...) (values allowed), flags=(...) (its flag
    names)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class ServerArgs:
    # The model and where it runs
    model_path: str = option("smollm2-135m-instruct", "short name or local HF folder",
                             flags=("--model", "--model-path"))
    device: str = option("cpu", "cpu, cuda or cuda:N")
    dtype: str | torch.dtype = option(
        "float32", "weights and KV cache dtype, converted at load; auto = the "
        "checkpoint's own", choices=DTYPES)
    attention_backend: str | None = option(
        None, "default: triton on CUDA, torch on CPU",
        choices=BACKENDS)

    # Memory: the KV pool (engine.plan_kv_pool)
    max_total_tokens: int | None = option(None,
                                          "KV pool size in tokens (default: sized from memory)")
    mem_fraction_static: float | None = option(
        None,
        "memory share for weights + KV cache (default: 0.88 of a GPU; CPU: 0.25 of the available "
        "RAM for "
        "the KV cache, at most 1 GiB)",
    )
    page_size: int = option(16, "tokens per KV-cache page")

    # Scheduling (scheduler/)
    max_running_requests: int = option(
        128, "requests in the running batch at most (rows of the page table)")
    max_prefill_tokens: int = option(
        16384, "prefill batch limit when chunking is off (a longer first prompt "
        "still runs whole)")
    chunked_prefill_size: int | None = option(
        None, "prefill tokens per batch; the prompt crossing it is cut into chunks "
        "(default: 2048 on a CPU, 512 on CUDA; -1: no chunking)")
    schedule_conservativeness: float = option(
        1.0, "scales the admission estimate new_token_ratio (higher: admit "
        "fewer, preempt less)")

    # Logging and statistics
    log_interval: int = option(0, "log throughput every N decode steps (0: never)")
    record_stats: bool = option(
        False, "keep every step's timings in llm.scheduler.timings (notebooks, benchmarks)")
    progress: bool | None = option(None,
                                   "loading progress bar (default: when stderr is a terminal)")

    def __post_init__(self) -> None:
        if isinstance(self.model_path, os.PathLike):
            self.model_path = os.fspath(self.model_path)
        hints = typing.get_type_hints(ServerArgs)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            check_type(f.name, value, hints[f.name])
            choices = f.metadata.get("choices")
            if choices and isinstance(value, str) and value not in choices:
                raise ValueError(f"unknown {f.name} {value!r}; choose one of {', '.join(choices)}")
        # None: the device's own (stage 4 README, 4.4)
        if self.chunked_prefill_size is None:
            on_cpu = self.device.split(":")[0] == "cpu"
            self.chunked_prefill_size = (CPU_CHUNKED_PREFILL_SIZE if on_cpu
                                         else CUDA_CHUNKED_PREFILL_SIZE)
        self.check()

    def check(self) -> None:
        """The values each option may take (types and choices are checked before)."""
        at_least(self, "page_size", 1)
        at_least(self, "max_running_requests", 1)
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens={self.max_total_tokens} holds no page of {self.page_size} tokens"
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        at_least(self, "max_prefill_tokens", 1)
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be >= 1, or -1 to disable chunking, got "
                             f"{self.chunked_prefill_size}")
        at_least(self, "schedule_conservativeness", 0)
        at_least(self, "log_interval", 0)

    # ---------------------------------------------------------------- the two doors
    @classmethod
    def from_kwargs(cls, caller: str = "LLM()", **kwargs) -> "ServerArgs":
        """ServerArgs(**kwargs), where an unknown option is a TypeError naming it (and the closest
        real one)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"{caller} got an unexpected keyword argument {name!r}{hint} (its options are "
                    "the fields of ServerArgs, server_args.py)")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field: its type, default, choices and help come from the field."""
        hints = typing.get_type_hints(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            kind = cli_type(hints[f.name])
            flags = f.metadata.get("flags", (f"--{f.name.replace('_', '-')}",))
            kwargs = dict(dest=f.name, default=f.default, help=f.metadata["help"])
            # False: a switch (--disable-x); None: --x / --no-x, unset = decided at run time
            if kind is bool:
                kwargs["action"] = (
                    argparse.BooleanOptionalAction if f.default is None else "store_true"
                )
            else:
                kwargs.update(type=kind, choices=f.metadata.get("choices"))
            parser.add_argument(*flags, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def check_type(name: str, value, hint) -> None:
    """TypeError unless value is one of the hint's types (an int passes for a float; a bool is not
    an int)."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in allowed:
        if t is type(None):
            ok = value is None
        elif isinstance(value, bool):  # True is an int to Python, not to an option
            ok = t is bool
        else:
            ok = isinstance(value, t) or (t is float and isinstance(value, int))
        if ok:
            return
    names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
    raise TypeError(f"{name} must be {names}, got {type(value).__name__} {value!r}")


def cli_type(hint) -> type:
    """The type a flag parses to: the hint's first of int, float, bool, str (None and torch.dtype
    dropped)."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next(t for t in allowed if t in (int, float, bool, str))


def at_least(args: ServerArgs, name: str, low: float) -> None:
    value = getattr(args, name)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
