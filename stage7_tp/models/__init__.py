"""The model zoo: the architecture name in config.json -> the class that runs it.

    "architectures": ["Qwen3ForCausalLM"]   ->   MODEL_REGISTRY["Qwen3ForCausalLM"]

Families share one decoder (llama.py); each other file holds only what its family changes.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..distributed import SINGLE, TPInfo, valid_tp_sizes
from ..layers import QKVParallelLinear, RMSNorm, RowParallelLinear
from .config import ModelConfig, RopeScaling, UnsupportedModelError
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3/3.1/3.2, SmolLM2, TinyLlama, ...
    "Qwen2ForCausalLM": Qwen2ForCausalLM,  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": Qwen3ForCausalLM,  # Qwen3 dense
    "MistralForCausalLM": MistralForCausalLM,  # Mistral 7B
}

__all__ = [
    "MODEL_REGISTRY", "ModelConfig", "RopeScaling", "UnsupportedModelError", "get_model_class",
    "build_model", "check_tp_size", "replicated_bytes"
]


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; this stage runs: "
            f"{', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                tp: TPInfo = SINGLE) -> nn.Module:
    """An empty model, allocated directly on `device` in `dtype`: no float32 copy first, no random
    init (the loader fills every parameter). Stage 2 built in float32 on the CPU and then cast: 2x
    the memory for bfloat16, and a host-RAM copy of the whole model before a GPU ever saw it. Stage
    7: only this rank's shard (`tp`)."""
    model_cls = get_model_class(cfg.architecture)
    check_tp_size(cfg, tp.size)
    with torch.device(device), default_dtype(dtype):
        model = model_cls(cfg, tp)
    return model.eval()


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse a tp_size that does not split the model, naming the sizes that do."""
    valid = [
        n for n in valid_tp_sizes(cfg.num_heads, cfg.num_kv_heads) if cfg.intermediate_size % n == 0
    ]
    if tp_size not in valid:
        raise ValueError(
            f"tp_size {tp_size} cannot split {cfg.architecture} ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, intermediate size {cfg.intermediate_size}); valid tp "
            "sizes: "
            f"{', '.join(map(str, valid))}"
        )


def replicated_bytes(model) -> int:
    """Weight bytes of this rank that tensor parallelism does not split: RMSNorm gains, the biases
    added after an all-reduce, and the K/V rows of a KV head held by several ranks (more ranks than
    KV heads)."""
    total = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, RowParallelLinear) and module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
        elif isinstance(module, QKVParallelLinear) and module.kv_replicas > 1:
            _, k_rows, _ = module.shard_offsets["k"]
            total += 2 * k_rows * module.weight.shape[1] * module.weight.element_size()
    return total
