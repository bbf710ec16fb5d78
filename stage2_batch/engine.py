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
from pathlib import Path

import torch

from .attention import ForwardBatch, create_backend
from .core import Batch, Req
from .kv_cache import BatchKVCache
from .model import LlamaForCausalLM, ModelConfig
from .sampler import sample
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


def read_eos_token_ids(model_path: Path, hf_config: dict) -> set[int]:
    """EOS may be one id or a list, in config.json and/or generation_config.json: take them all."""
    ids: set[int] = set()
    sources = [hf_config]
    gen_file = model_path / "generation_config.json"
    if gen_file.exists():
        sources.append(json.loads(gen_file.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class Engine:

    def __init__(self, model_path: str | Path, device: str = "cpu",
                 dtype: str | torch.dtype = "float32", attention_backend: str | None = None,
                 max_batch_size: int = 32):
        model_path = Path(model_path)
        if not (model_path / "config.json").exists():
            raise FileNotFoundError(
                f"no config.json in {model_path}: not a Hugging Face model folder")
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        hf_config = json.loads((model_path / "config.json").read_text())
        self.config = ModelConfig.from_hf(hf_config)
        self.device, self.dtype, self.max_batch_size = check_device(device), dtype, max_batch_size
        self.eos_token_ids = read_eos_token_ids(model_path, hf_config)
        self.attn_backend = create_backend(attention_backend, self.device)

        self.model = LlamaForCausalLM(self.config).to(self.device).eval()
        # cast the weights only: RoPE's inv_freq buffer stays float32
        for param in self.model.parameters():
            # (in bfloat16 it is off by up to 0.4%: radians by position ~1000)
            param.data = param.data.to(dtype)
        load_weights(self.model, model_path)

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
