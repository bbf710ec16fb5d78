"""Engine v0: one request at a time. Prefill the prompt once, then decode one token per forward
pass.

    prompt ids --prefill--> logits of the last prompt token --sample--> token 1
    token 1   --decode----> logits --sample--> token 2   ... until EOS / a stop token /
                                                         max_new_tokens

Each forward pass feeds only the tokens whose K/V are not cached yet (`req.next_input_ids()`), at
positions cached_len .. device_len-1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .core import Req
from .kv_cache import GrowingKVCache, StaticKVCache
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
                 dtype: str | torch.dtype = "float32", kv_cache: str = "static"):
        model_path = Path(model_path)
        if not (model_path / "config.json").exists():
            raise FileNotFoundError(
                f"no config.json in {model_path}: not a Hugging Face model folder")
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        if kv_cache not in ("static", "growing"):
            raise ValueError(f"kv_cache must be 'static' or 'growing', got {kv_cache!r}")
        hf_config = json.loads((model_path / "config.json").read_text())
        self.config = ModelConfig.from_hf(hf_config)
        self.device, self.dtype, self.kv_cache_kind = check_device(device), dtype, kv_cache
        self.eos_token_ids = read_eos_token_ids(model_path, hf_config)

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

    def new_kv_cache(self, req: Req):
        cfg = self.config
        if self.kv_cache_kind == "growing":
            return GrowingKVCache(cfg.num_layers)
        # Preallocate exactly what this request can ever hold.
        max_len = min(req.max_device_len, self.max_context_len)
        return StaticKVCache(cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                             self.device)

    def forward(self, req: Req, kv_cache) -> torch.Tensor:
        """Feed the request's uncached tokens; return the logits of the last one: [vocab]."""
        input_ids = torch.tensor(req.next_input_ids(), dtype=torch.long, device=self.device)  # [T]
        positions = torch.arange(req.cached_len, req.device_len, device=self.device)  # [T]
        return self.model(input_ids, positions, kv_cache)

    def prefill(self, req: Req, kv_cache) -> torch.Tensor:
        assert req.cached_len == 0 and req.extend_len == len(req.input_ids)
        return self.forward(req, kv_cache)

    def decode_one_token(self, req: Req, kv_cache) -> torch.Tensor:
        assert req.extend_len == 1
        return self.forward(req, kv_cache)

    def check_stop(self, req: Req, token_id: int) -> None:
        params = req.sampling_params
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and
                                                 not params.ignore_eos):
            req.finished, req.finish_reason = True, "stop"
        elif len(req.output_ids) >= params.max_new_tokens or req.device_len >= self.max_context_len:
            req.finished, req.finish_reason = True, "length"

    def generate(self, req: Req) -> Req:
        """Run one request to completion: prefill, then decode until a stop condition."""
        self.check_prompt_fits(len(req.input_ids))
        kv_cache = self.new_kv_cache(req)
        generator = None
        if req.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(req.sampling_params.seed)

        logits = self.prefill(req, kv_cache)
        while True:
            token_id = sample(logits, req.sampling_params, generator)
            req.complete_one(token_id)
            self.check_stop(req, token_id)
            req.check_invariants()
            if req.finished:
                return req
            logits = self.decode_one_token(req, kv_cache)
