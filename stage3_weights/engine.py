"""Engine v1: static batching. A batch of requests starts together, shares every forward pass, and
ends when its last request finishes.

    prefill:  the prompts of all B requests, packed into one [N] token row (N = sum of prompt
              lengths)
    decode:   one token per unfinished request, [B'] tokens; finished requests leave the batch
    sample:   one next token per request from the [B, vocab] logits of the requests' last tokens

Packing (`cu_seqlens`) instead of padding to the longest prompt means no matmul row is spent on pad
tokens; `pad_to_longest=True` keeps the padded version around to measure that waste.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import ForwardBatch, create_backend
from .core import Batch, Req
from .kv_cache import BatchKVCache
from .models import ModelConfig, build_model
from .sampler import sample
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


class Engine:

    def __init__(self, model_path: str | Path, device: str = "cpu",
                 dtype: str | torch.dtype = "float32", attention_backend: str | None = None,
                 max_batch_size: int = 32, eos_token_ids: set[int] | None = None,
                 progress: bool | None = None, verbose: bool = True):
        """eos_token_ids: the tokenizer's (tokenizer.py); default: read from the checkpoint's
        configs. progress: a progress bar while loading (None: when stderr is a terminal). verbose:
        one line on load."""
        model_path = Path(model_path)
        if not (model_path / "config.json").exists():
            raise FileNotFoundError(
                f"no config.json in {model_path}: not a Hugging Face model folder")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        hf_config = json.loads((model_path / "config.json").read_text())
        config = ModelConfig.from_hf(hf_config)  # refuses what it cannot run, before any allocation
        dtype = resolve_dtype(dtype, config)
        self.device, self.dtype, self.max_batch_size = check_device(device), dtype, max_batch_size
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids else read_eos_token_ids(
            model_path, hf_config)
        self.attn_backend = create_backend(attention_backend, self.device)

        # empty, already in its dtype and on its device
        self.model = build_model(config, self.device, dtype)
        self.config = self.model.config  # the family's view (e.g. Qwen2 adds qkv_bias)
        self.load_stats = load_weights(self.model, model_path, progress=progress)
        if verbose:
            s = self.load_stats
            print(
                f"[{type(self.model).__name__} from {model_path.name}: {s.tensors} tensors from "
                f"{s.files} "
                f"file(s) in {s.seconds:.2f} s] {self.memory_report().summary()}",
                file=sys.stderr,
            )

    def memory_report(self) -> MemoryReport:
        by_dtype: dict[str, int] = {}
        num_params = 0
        for param in self.model.parameters():  # parameters() yields a tied matrix once
            name = str(param.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + param.numel() * param.element_size()
            num_params += param.numel()
        cfg = self.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
        return MemoryReport(by_dtype, num_params, kv_per_token,
                            str(self.dtype).removeprefix("torch."), self.max_context_len)

    @property
    def max_context_len(self) -> int:
        return self.config.max_position_embeddings

    def check_prompt_fits(self, prompt_len: int) -> None:
        if prompt_len >= self.max_context_len:
            raise ValueError(f"prompt has {prompt_len} tokens; the model's context is "
                             f"{self.max_context_len}, leaving no room to generate")

    def new_kv_cache(self, reqs: list[Req]) -> BatchKVCache:
        # Static batching sizes every slot for the longest request the batch may grow to.
        max_len = min(max(r.max_device_len for r in reqs), self.max_context_len)
        cfg = self.config
        return BatchKVCache(cfg.num_layers, len(reqs), max_len, cfg.num_kv_heads, cfg.head_dim,
                            self.dtype, self.device)

    def prepare(self, batch: Batch, kv_cache: BatchKVCache,
                pad_to_longest: bool = False) -> ForwardBatch:
        """Pack the batch's uncached tokens into flat tensors plus the metadata attention needs."""
        pad_len = max(r.extend_len for r in batch.reqs) if pad_to_longest else 0
        input_ids, positions, token_slots, seqlens, last = [], [], [], [], []
        for req in batch.reqs:
            ids = req.next_input_ids()  # extend_len tokens
            # padded: every request occupies pad_len rows, pads at the end
            n = max(len(ids), pad_len)
            input_ids += ids + [0] * (n - len(ids))
            positions += range(req.cached_len, req.cached_len + n)
            token_slots += [req.slot] * n
            last.append(len(input_ids) - n + len(ids) - 1)  # the last *real* token of this request
            seqlens.append(n)
        dev = self.device
        cu_seqlens = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return ForwardBatch(
            phase=batch.phase,
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),  # [N]
            positions=torch.tensor(positions, dtype=torch.long, device=dev),  # [N]
            token_slot_ids=torch.tensor(token_slots, dtype=torch.long, device=dev),  # [N]
            # [B]
            slot_ids=torch.tensor([r.slot for r in batch.reqs], dtype=torch.int32, device=dev),
            # [B]
            seq_lens=torch.tensor([r.device_len for r in batch.reqs], dtype=torch.int32,
                                  device=dev),
            cu_seqlens=cu_seqlens.to(dev),  # [B+1]
            max_seqlen=max(seqlens),
            last_token_indices=torch.tensor(last, dtype=torch.long, device=dev),  # [B]
            kv_cache=kv_cache,
            attn_backend=self.attn_backend,
        )

    def forward(self, batch: Batch, kv_cache: BatchKVCache,
                pad_to_longest: bool = False) -> torch.Tensor:
        fb = self.prepare(batch, kv_cache, pad_to_longest)
        return self.model(fb.input_ids, fb.positions, fb)  # [B, vocab]

    def prefill(self, batch: Batch, kv_cache: BatchKVCache,
                pad_to_longest: bool = False) -> torch.Tensor:
        assert batch.phase == "prefill" and all(r.cached_len == 0 for r in batch.reqs)
        return self.forward(batch, kv_cache, pad_to_longest)

    def decode(self, batch: Batch, kv_cache: BatchKVCache) -> torch.Tensor:
        assert batch.phase == "decode" and all(r.extend_len == 1 for r in batch.reqs)
        return self.forward(batch, kv_cache)

    def check_stop(self, req: Req, token_id: int) -> None:
        params = req.sampling_params
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and
                                                 not params.ignore_eos):
            req.finished, req.finish_reason = True, "stop"
        elif len(req.output_ids) >= params.max_new_tokens or req.device_len >= self.max_context_len:
            req.finished, req.finish_reason = True, "length"

    def generate(self, reqs: list[Req], pad_to_longest: bool = False) -> list[Req]:
        """Run requests to completion, max_batch_size at a time (static batching: a batch ends when
        all are done)."""
        for i in range(0, len(reqs), self.max_batch_size):
            self.generate_batch(reqs[i : i + self.max_batch_size], pad_to_longest)
        return reqs

    def generate_batch(self, reqs: list[Req], pad_to_longest: bool = False) -> list[Req]:
        for req in reqs:
            self.check_prompt_fits(len(req.input_ids))
        kv_cache = self.new_kv_cache(reqs)
        for req in reqs:
            req.slot = kv_cache.alloc_slot()
        generators = [
            None if r.sampling_params.seed is None else torch.Generator(
                device=self.device).manual_seed(r.sampling_params.seed) for r in reqs
        ]
        gen_of = {r.rid: g for r, g in zip(reqs, generators)}

        running = list(reqs)
        logits = self.prefill(Batch(running, "prefill"), kv_cache, pad_to_longest)  # [B, vocab]
        while True:
            token_ids = sample(logits, [r.sampling_params for r in running],
                               [gen_of[r.rid] for r in running])
            for req, token_id in zip(running, token_ids):
                req.complete_one(token_id)
                self.check_stop(req, token_id)
                req.check_invariants()
            running = [r for r in running if not r.finished]  # finished requests leave the batch
            if not running:
                break
            logits = self.decode(Batch(running, "decode"), kv_cache)  # [B', vocab]
        for req in reqs:
            kv_cache.free_slot(req.slot)
        return reqs
