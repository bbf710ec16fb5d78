"""The engine: the model, the paged KV pool and page table, and one forward pass of a Batch. No
scheduling here: the scheduler decides which requests run, gives them pages, and calls `forward`.

    prefill batch: the uncached tokens of each request (a whole prompt, a chunk of one, or a
                   preempted request's prompt + output to recompute), packed into [N]
    decode batch:  one token per running request, [B]
    both:          -> logits [B, vocab] of each request's last fed token

Stage 5 splits `forward` into `prepare` (host: build the tensors; the overlap scheduler runs it on
the CPU while the device is busy with the previous step) and `run` (device: the model, by CUDA-graph
replay for decode batches on a GPU, eagerly otherwise). An input id < 0 is a *future token*: -(row +
1) stands for the token the previous step sampled for page-table row `row`, which is still on the
device in `future_tokens` (see scheduler.py).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import ForwardBatch, create_backend
from .core import Batch
from .graph import CompiledRunner, GraphRunner, can_capture
from .kv_cache import HUGE_PAGE, PageTable, PagedKVPool, advise_huge_pages
from .layers import pack_linear_weights
from .models import ModelConfig, build_model
from .tokenizer import read_eos_token_ids
from .weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str | torch.device) -> torch.device:
    """The torch.device for `device`, refusing one this machine lacks with a message that says so
    (not a traceback from deep inside torch at the first allocation)."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(dev)!r} asked for, but torch {torch.__version__} sees no CUDA GPU here; "
            "use device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {str(dev)!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
            "GPU(s)"
        )
    return dev


def keep_freed_memory_in_heap() -> None:
    """On Linux (glibc), stop malloc from handing big freed blocks back to the OS.

    A forward pass allocates and frees the same activations every step (a 512-token chunk's MLP
    input alone is 3 MB). By default glibc serves blocks that large with fresh mmap()s and unmaps
    them when freed, so every step page-faults its activations in again, zeroed by the kernel.
    Raising the mmap threshold to its maximum (32 MiB) and never trimming the heap keeps those
    blocks for reuse: measured, stage 4's offline run ~8% faster in float32 on a 2-core CPU. vLLM's
    CPU build gets the same by preloading tcmalloc. Process-wide, and a no-op elsewhere."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def weights_into_huge_pages(model: torch.nn.Module) -> None:
    """Move the model's weights, packed and plain, into 2 MB pages (kv_cache.advise_huge_pages).

    A decode step reads every weight once, from memory: hundreds of MB, far more than the caches
    hold. With 4 KB pages that is a page-table walk every 4 KB, which stalls the matmuls; the CPU's
    address cache covers ~1000x more memory with 2 MB pages. Weights are written (loaded, packed)
    before they can be advised, so they are collapsed in place, a copy of each at start-up.
    Measured on a 2-core EPYC (`python -m common.bench weight-pages`): the products of one decode
    step take 21% less time with one row, 8% less with 64, in float32. Tensors lying within 2 MB
    of each other are advised as one span, so that the many small ones share pages."""
    spans: list[list[int]] = []
    for start, end in sorted(map(byte_span, [*model.parameters(), *model.buffers()])):
        if spans and start - spans[-1][1] < HUGE_PAGE:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    for start, end in spans:
        advise_huge_pages(start, end, collapse=True)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [start, end) of a tensor's data, plain or packed (layers.pack_weight)."""
    if t.is_mkldnn:
        start = torch.ops.mkldnn.data_ptr(t)
        return start, start + torch.ops.mkldnn._nbytes(t)
    return t.data_ptr(), t.data_ptr() + t.nbytes


@dataclass
class MemoryReport:
    """What the model costs in memory: the weights once, plus the KV cache per token of every
    sequence."""

    param_bytes_by_dtype: dict[str, int]  # unique storage: a tied lm_head is counted once
    num_params: int
    kv_bytes_per_token: int  # 2 (K and V) * layers * kv_heads * head_dim * bytes per element
    kv_dtype: str
    max_context_len: int

    @property
    def param_bytes(self) -> int:
        return sum(self.param_bytes_by_dtype.values())

    def summary(self) -> str:
        by_dtype = ", ".join(f"{d} {_mb(b)}" for d, b in self.param_bytes_by_dtype.items())
        return (
            f"weights {_mb(self.param_bytes)} ({self.num_params / 1e6:.1f}M params: {by_dtype}); "
            f"KV cache {self.kv_bytes_per_token / 1024:.1f} KiB/token ({self.kv_dtype}), "
            f"{_mb(self.kv_bytes_per_token * self.max_context_len)} for one "
            f"{self.max_context_len}-token sequence"
        )


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """A torch dtype, a name, or "auto": the checkpoint's own dtype (float32 when config.json does
    not say)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = cfg.dtype if cfg.dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    return DTYPES[dtype]


# a CPU's default: this share of the RAM available after loading the weights ...
CPU_KV_FRACTION = 0.25
# ... but at most 1 GiB (zeroing the pool costs start-up time; pass max_total_tokens)
CPU_KV_CAP_BYTES = 1 << 30
# a GPU's default: weights + KV cache may use this share of the device's memory
GPU_MEM_FRACTION_STATIC = 0.88


@dataclass
class KVPoolPlan:
    """How many tokens the KV pool holds, and why."""

    num_pages: int
    page_size: int
    bytes_per_token: int
    reason: str

    @property
    def max_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    def summary(self) -> str:
        return (
            f"KV pool {self.max_total_tokens} tokens ({self.num_pages} pages of {self.page_size}), "
            f"{_mb(self.max_total_tokens * self.bytes_per_token)}: {self.reason}")


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux): what can be allocated without swapping; else the
    physical RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_kv_pool(device: torch.device, bytes_per_token: int, page_size: int, max_total_tokens: int
                 | None, mem_fraction_static: float | None, max_tokens_needed: int) -> KVPoolPlan:
    """Size the KV pool as SGLang does, once the weights are loaded.

    - max_total_tokens given: exactly that many tokens (rounded down to whole pages).
    - CUDA: weights + KV may take mem_fraction_static of the GPU; the rest is left for activations,
      CUDA graphs and the allocator. KV bytes = free now - total * (1 - mem_fraction_static).
    - CPU: mem_fraction_static (default 0.25) of the RAM available now, capped at 1 GiB.
    Never more than max_tokens_needed (every row of the page table at the full context): the rest
    could not be used.
    """
    if max_total_tokens is not None:
        return KVPoolPlan(max_total_tokens // page_size, page_size, bytes_per_token,
                          "max_total_tokens")
    if device.type == "cuda":
        frac = GPU_MEM_FRACTION_STATIC if mem_fraction_static is None else mem_fraction_static
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1 - frac)
        reason = (
            f"mem_fraction_static={frac} of {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
            "after "
            "the weights"
        )
    else:
        frac = CPU_KV_FRACTION if mem_fraction_static is None else mem_fraction_static
        available = available_ram_bytes()
        budget = min(frac * available, CPU_KV_CAP_BYTES)
        reason = (
            f"{frac} of {available / 2**30:.1f} GiB available RAM, at most "
            f"{CPU_KV_CAP_BYTES >> 30} GiB"
        )
    tokens = int(budget // bytes_per_token)
    # more than every page-table row at the full context could ever use
    if tokens > max_tokens_needed:
        tokens, reason = max_tokens_needed, "max_running_requests x the context length"
    if tokens < page_size:
        raise ValueError(
            f"no room for a KV cache: {reason} gives {max(budget, 0) / 2**20:.1f} MiB, less than "
            "one "
            f"page of {page_size} tokens ({bytes_per_token} bytes per token); raise "
            "mem_fraction_static or pass max_total_tokens"
        )
    return KVPoolPlan(tokens // page_size, page_size, bytes_per_token, reason)


def to_device(lists: list[list[int]], dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
    """The step's index lists as tensors on `device`: one host buffer (pinned on CUDA) and one
    copy that does not wait, instead of a blocking copy from pageable memory for each list (~10 us
    of the host's time apiece on a GPU). The results are views of the one device buffer."""
    flat = torch.tensor([x for xs in lists for x in xs], dtype=dtype,
                        pin_memory=device.type == "cuda")
    return list(flat.to(device, non_blocking=True).split([len(xs) for xs in lists]))


class Engine:

    def __init__(self, model_path: str | Path, device: str = "cpu",
                 dtype: str | torch.dtype = "float32", attention_backend: str | None = None,
                 page_size: int = 16, max_running_requests: int = 128,
                 max_total_tokens: int | None = None, mem_fraction_static: float | None = None,
                 eos_token_ids: set[int] | None = None, progress: bool | None = None,
                 verbose: bool = True, cuda_graph: bool = True, cuda_graph_max_bs: int = 64,
                 enable_torch_compile: bool = False, torch_compile_max_bs: int = 8):
        """max_total_tokens: the KV pool's size in tokens (default: sized from memory, see
        plan_kv_pool). mem_fraction_static: the share of memory for weights + KV cache (default 0.88
        of a GPU; on a CPU 0.25 of the available RAM, for the KV cache alone, at most 1 GiB).
        eos_token_ids: the tokenizer's (tokenizer.py); default: read from the checkpoint's configs.
        progress: a progress bar while loading (None: when stderr is a terminal). verbose: one line
        on load. enable_torch_compile (CPU): decode batches of up to torch_compile_max_bs requests
        run torch.compile'd code, one graph per CUDA-graph bucket (graph.py)."""
        model_path = Path(model_path)
        if not (model_path / "config.json").exists():
            raise FileNotFoundError(
                f"no config.json in {model_path}: not a Hugging Face model folder")
        if page_size < 1 or max_running_requests < 1:
            raise ValueError(f"page_size and max_running_requests must be >= 1, got {page_size}, "
                             f"{max_running_requests}")
        # checked on every device: a setting that would fail on a GPU fails here too
        if cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {cuda_graph_max_bs}")
        if enable_torch_compile and torch_compile_max_bs < 1:
            raise ValueError(f"torch_compile_max_bs must be >= 1, got {torch_compile_max_bs}")
        if max_total_tokens is not None and max_total_tokens < page_size:
            raise ValueError(
                f"max_total_tokens={max_total_tokens} holds no page of {page_size} tokens")
        if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
        hf_config = json.loads((model_path / "config.json").read_text())
        config = ModelConfig.from_hf(hf_config)  # refuses what it cannot run, before any allocation
        dtype = resolve_dtype(dtype, config)
        self.device, self.dtype = check_device(device), dtype
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids else read_eos_token_ids(
            model_path, hf_config)
        self.attn_backend = create_backend(attention_backend, self.device)

        # empty, already in its dtype and on its device
        self.model = build_model(config, self.device, dtype)
        self.config = cfg = self.model.config  # the family's view (e.g. Qwen2 adds qkv_bias)
        self.load_stats = load_weights(self.model, model_path, progress=progress)
        # On a CPU, oneDNN's layout for every matmul weight (layers.py): the same products, faster
        self.packed_weights = pack_linear_weights(self.model)
        if self.device.type == "cpu":
            weights_into_huge_pages(self.model)

        # The KV pool is sized once, after the weights are in memory: every page any request will
        # ever use is here.
        bytes_per_token = PagedKVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads,
                                                      cfg.head_dim, dtype)
        self.kv_plan = plan_kv_pool(self.device, bytes_per_token, page_size, max_total_tokens,
                                    mem_fraction_static,
                                    max_tokens_needed=max_running_requests * self.max_context_len)
        # CUDA graphs pad batches with rows whose K/V must land somewhere harmless: one extra page
        # that the cache manager never sees (num_pages stays the usable count) holds the dummy slot.
        use_graphs = cuda_graph and can_capture(self.device)
        if enable_torch_compile and self.device.type != "cpu":
            raise ValueError(
                "enable_torch_compile is the CPU's stand-in for CUDA graphs; on CUDA the graphs run"
            )
        use_compile = enable_torch_compile and not use_graphs
        num_pages = self.kv_plan.num_pages
        self.kv_pool = PagedKVPool(cfg.num_layers, num_pages + int(use_graphs or use_compile),
                                   page_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.kv_pool.num_pages = num_pages
        # first slot of the reserved page (used only with graphs)
        self.dummy_slot = num_pages * page_size
        if verbose:
            s = self.load_stats
            print(
                f"[{type(self.model).__name__} from {model_path.name}: {s.tensors} tensors from "
                f"{s.files} "
                f"file(s) in {s.seconds:.2f} s] {self.memory_report().summary()}; "
                f"{self.kv_plan.summary()}",
                file=sys.stderr,
            )
        max_pages_per_req = -(-self.max_context_len // page_size)
        self.page_table = PageTable(max_running_requests, max_pages_per_req, self.device)

        # Stage 5: the last sampled token of each page-table row, kept on the device for the next
        # step's input. [rows]
        self.future_tokens = torch.zeros(max_running_requests, dtype=torch.long, device=self.device)
        # which path ran (the tests check CPU stays eager)
        self.num_graph_replays = self.num_eager_forwards = 0
        self.graph_runner = GraphRunner(self, min(cuda_graph_max_bs,
                                                  max_running_requests)) if use_graphs else None
        if use_compile:
            self.graph_runner = CompiledRunner(self, min(torch_compile_max_bs,
                                                         max_running_requests))
            if verbose:
                times = ", ".join(f"{bs}: {t:.1f} s"
                                  for bs, t in sorted(self.graph_runner.compile_seconds.items()))
                print(f"[torch.compile of the decode forward, per batch-size bucket: {times}]",
                      file=sys.stderr)

    def memory_report(self) -> MemoryReport:
        by_dtype: dict[str, int] = {}
        num_params = 0
        for param in self.model.parameters():  # parameters() yields a tied matrix once
            name = str(param.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + param.numel() * param.element_size()
            num_params += param.numel()
        cfg = self.config
        kv_per_token = PagedKVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                   self.dtype)
        return MemoryReport(by_dtype, num_params, kv_per_token,
                            str(self.dtype).removeprefix("torch."), self.max_context_len)

    @property
    def max_context_len(self) -> int:
        return self.config.max_position_embeddings

    def check_prompt_fits(self, prompt_len: int) -> None:
        if prompt_len >= self.max_context_len:
            raise ValueError(f"prompt has {prompt_len} tokens; the model's context is "
                             f"{self.max_context_len}, leaving no room to generate")

    def prepare(self, batch: Batch) -> ForwardBatch:
        """Pack the batch's uncached tokens into flat tensors plus the metadata attention needs."""
        input_ids, positions, seqlens, last = [], [], [], []
        for req in batch.reqs:
            ids = req.next_input_ids()  # extend_len tokens
            input_ids += ids
            positions += range(req.cached_len, req.device_len)
            seqlens.append(len(ids))
            last.append(len(input_ids) - 1)
        assert len(batch.out_cache_loc) == len(
            input_ids), "the scheduler must give every new token a KV slot"
        prefix_lens = [r.cached_len for r in batch.reqs]
        seq_lens = [r.device_len for r in batch.reqs]
        input_ids, positions, out_cache_loc, last_token_indices = to_device(
            [input_ids, positions, batch.out_cache_loc, last], torch.long, self.device)
        req_rows, prefix_lens_t, seq_lens_t, cu_seqlens = to_device(
            [[r.table_idx for r in batch.reqs], prefix_lens, seq_lens,
             [0, *itertools.accumulate(seqlens)]], torch.int32, self.device)
        fb = ForwardBatch(
            phase=batch.phase,
            input_ids=input_ids,  # [N]
            positions=positions,  # [N]
            out_cache_loc=out_cache_loc,  # [N]
            req_rows=req_rows,  # [B]
            prefix_lens=prefix_lens_t,  # [B]
            seq_lens=seq_lens_t,  # [B]
            cu_seqlens=cu_seqlens,  # [B+1]
            max_seqlen=max(seqlens),
            max_seq_len=max(seq_lens),
            prefix_lens_cpu=prefix_lens,
            seq_lens_cpu=seq_lens,
            last_token_indices=last_token_indices,  # [B]
            kv_pool=self.kv_pool,
            page_table=self.page_table.table,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(fb)  # once per pass, not once per layer
        return fb

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.run(self.prepare(batch))  # [B, vocab]

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The device half of a step: resolve future tokens, then graph replay (decode on CUDA) or
        eager."""
        # [N]; -(row + 1) = "the token row `row` sampled last step", still on the device
        ids = fb.input_ids
        fb.input_ids = torch.where(ids < 0, self.future_tokens[(-ids - 1).clamp(min=0)], ids)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            self.num_graph_replays += 1
            return self.graph_runner.replay(fb)  # [B, vocab]
        self.num_eager_forwards += 1
        return self.model(fb.input_ids, fb.positions, fb)  # [B, vocab]
