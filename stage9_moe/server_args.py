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
from .engine import LOAD_FORMATS
from .kv_quant import KV_CACHE_DTYPES
from .moe import MOE_RUNNER_BACKENDS
from .quantization import QUANT_METHODS
from .scheduler.scheduler import SCHEDULE_POLICIES
from .speculative import SPECULATIVE_ALGORITHMS

DTYPES = ("float32", "bfloat16", "float16", "auto")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
# On a CPU a token costs less in a larger prefill step (larger matmuls), and a prompt cut in fewer
# chunks puts fewer small decode steps between them (stage 4 README, 4.4).
CPU_CHUNKED_PREFILL_SIZE, CUDA_CHUNKED_PREFILL_SIZE = 2048, 512


def option(default, help: str, **cli):
    """A field with its help text. cli: choices=(...) (values allowed), flags=(...) (its flag
    names), const=v (the flag sets v: a switch whose unset default is None)."""
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
        None, "default: triton on CUDA; on a CPU cpu (C++ kernels, built on first use), "
        "or torch if they cannot build",
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
    kv_cache_dtype: str = option(
        "auto", "KV cache storage: auto = the model's dtype; int8 / fp8_e4m3 = one byte per value "
        "plus a float32 scale per token and KV head (kv_quant.py)", choices=KV_CACHE_DTYPES)

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

    # Stage 5: CUDA graphs (graph.py), their CPU stand-in, and the overlap loop
    # (scheduler/overlap.py)
    disable_cuda_graph: bool = option(False, "decode eagerly on CUDA too")
    cuda_graph_max_bs: int = option(64, "largest batch captured in a graph")
    enable_torch_compile: bool = option(
        False, "CPU: decode batches of up to --torch-compile-max-bs run "
        "torch.compile'd code, one graph per bucket (compiling takes a while at "
        "start-up)")
    torch_compile_max_bs: int = option(8, "largest batch compiled")
    # None: overlap on CUDA, not on a CPU (README, Figures); --enable-overlap sets False.
    disable_overlap: bool | None = option(
        None, "process each step's results before launching the next (stage 4's "
        "loop; the CPU default)", const=True)

    # Stage 6: the prefix cache (radix_cache.py) and the waiting queue's order
    disable_radix_cache: bool = option(False, "no prefix cache (stage 5's engine)")
    schedule_policy: str = option(
        "lpm", "waiting-queue order within a priority: longest cached prefix first, or "
        "arrival order", choices=SCHEDULE_POLICIES)

    # Stage 7: tensor parallelism (distributed.py, tp_worker.py)
    tp_size: int = option(1, "tensor parallelism: ranks the model is split over")
    nnodes: int = option(1, "machines the tp ranks are spread over")
    node_rank: int = option(
        0, "this machine's index; node 0 runs the requests, the others serve their ranks")
    dist_init_addr: str | None = option(None, "host:port where rank 0 listens (multi-node)")
    gpu_id_step: int = option(
        1, "CUDA: rank r of a node runs on GPU r * gpu_id_step; 0 puts every rank on one GPU "
        "(gloo between the ranks, no CUDA graphs, max_total_tokens required: a rehearsal of the "
        "sharding, not a speed-up)")
    enable_tp_sync_check: bool = option(
        False, "compare every step's batch and sampled tokens across the tp ranks; "
        "raise where they differ (a debugging guard: one gather per step)")
    load_format: str = option("auto",
                              "dummy: random weights of the checkpoint's shapes (no weights read)",
                              choices=LOAD_FORMATS)

    # Stage 8: the HTTP server (server/)
    host: str = option("127.0.0.1", "server: address to listen on")
    port: int = option(30000, "server: port (0: any free port)")
    served_model_name: str | None = option(
        None, "server: the model name clients send and /v1/models lists "
        "(default: --model)")
    log_level: str = option("warning", "server: uvicorn's log level", choices=LOG_LEVELS)
    # Who may use the server, and how much one request may ask (README, "Exposing the server")
    api_key: str | None = option(
        None, "server: require `Authorization: Bearer KEY` on every route but /health and the "
        "playground page (default: $SGLANG_API_KEY; neither set: no key)")
    allowed_origins: str | None = option(
        None, "server: comma-separated web origins whose pages may call the API (CORS), e.g. "
        "http://localhost:5173 (default: none, only the server's own pages)")
    allowed_hosts: str | None = option(
        None, "server: comma-separated Host names to answer besides the address it listens on "
        "(a proxy's or DNS name; default: that address, and localhost on a loopback one)")
    max_request_body_bytes: int = option(16 * 2**20, "server: largest request body (413 above)")
    max_requests_per_call: int = option(
        256, "server: engine requests one HTTP request may make, prompts x n (400 above)")
    grammar_compile_timeout: float = option(
        30.0, "seconds a request's grammar (json_schema, regex, ebnf) may take to compile; past "
        "it the request fails alone")

    # Stage 9: mixture-of-experts layers (moe.py)
    moe_runner_backend: str = option(
        "auto", "MoE layers: fused Triton kernels (triton), the per-expert reference "
        "loop (torch); auto = triton on CUDA, torch on CPU", choices=MOE_RUNNER_BACKENDS)
    # Quantized weights (quantization.py): fewer bytes per weight, fewer bytes read per token
    quantization: str | None = option(
        None, "linear layers' weights: q4_1 / q8_0 = a GGUF file's own blocks, kept as they are; "
        "int8 = weight-only int8 per output row, from any float checkpoint; q4_1_a8 / q8_0_a8 = "
        "those blocks times activations rounded to int8 per block, as llama.cpp (lossy, faster)",
        choices=QUANT_METHODS)
    # Speculative decoding (speculative/): draft k tokens, verify them in one pass of the model
    speculative_algorithm: str | None = option(
        None, "NGRAM: drafts copied from the request's own prompt and output; STANDALONE: a small "
        "draft model with the same tokenizer (--speculative-draft-model-path)",
        choices=SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int = option(
        4, "tokens drafted per request per step (the verify pass feeds them + 1)")
    speculative_draft_model_path: str | None = option(
        None, "STANDALONE: the draft model (short name or local HF folder)")

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
        # on every device: a setting that would fail on a GPU fails here too
        at_least(self, "cuda_graph_max_bs", 1)
        at_least(self, "torch_compile_max_bs", 1)
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a positive multiple of nnodes ({self.nnodes})")
        at_least(self, "gpu_id_step", 0)
        if (self.gpu_id_step == 0 and self.tp_size > 1 and self.device.startswith("cuda")
                and self.max_total_tokens is None):
            raise ValueError("ranks sharing one GPU (gpu_id_step 0) would each size the KV pool "
                             "from the same free memory: pass max_total_tokens")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, {self.nnodes}) for nnodes={self.nnodes}, got "
                f"{self.node_rank}"
            )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        elif self.nnodes > 1:
            raise ValueError(
                "nnodes > 1 needs dist_init_addr (host:port of rank 0, reachable from every node)")
        self.check_speculative()
        if self.quantization is not None and self.tp_size != 1:
            raise ValueError(f"quantization={self.quantization!r} runs with tp_size 1 only")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        at_least(self, "max_request_body_bytes", 1024)
        at_least(self, "max_requests_per_call", 1)
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        for origin in comma_list(self.allowed_origins):
            scheme, _, rest = origin.partition("://")
            if origin != "*" and (scheme not in ("http", "https") or not rest or "/" in rest):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin like "
                                 "http://host:port (or *, any origin)")

    def check_speculative(self) -> None:
        at_least(self, "speculative_num_draft_tokens", 1)
        standalone = self.speculative_algorithm == "STANDALONE"
        if standalone and not self.speculative_draft_model_path:
            raise ValueError("speculative_algorithm STANDALONE needs speculative_draft_model_path")
        if self.speculative_draft_model_path and not standalone:
            raise ValueError("speculative_draft_model_path is used by speculative_algorithm "
                             "STANDALONE only")
        if self.speculative_algorithm and self.disable_overlap is False:
            raise ValueError("speculative decoding runs without overlap scheduling (its drafts "
                             "are proposed from the tokens on the host): drop --enable-overlap")

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
            # a switch to a value other than True / False (disable_overlap)
            if "const" in f.metadata:
                kwargs.update(action="store_const", const=f.metadata["const"])
            # False: a switch (--disable-x); None: --x / --no-x, unset = decided at run time
            elif kind is bool:
                kwargs["action"] = (
                    argparse.BooleanOptionalAction if f.default is None else "store_true"
                )
            else:
                kwargs.update(type=kind, choices=f.metadata.get("choices"))
            parser.add_argument(*flags, **kwargs)
        parser.add_argument("--enable-overlap", action="store_const", const=False,
                            dest="disable_overlap",
                            help="overlap scheduling on a CPU too (on CUDA it is the default)")

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


def comma_list(value: str | None) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c']; None -> []."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def at_least(args: ServerArgs, name: str, low: float) -> None:
    value = getattr(args, name)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
