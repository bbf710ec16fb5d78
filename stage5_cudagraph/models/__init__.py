"""The model zoo: the architecture name in config.json -> the class that runs it.

    "architectures": ["Qwen3ForCausalLM"]   ->   MODEL_REGISTRY["Qwen3ForCausalLM"]

Families share one decoder (llama.py); each other file holds only what its family changes.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

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
    "build_model"
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


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """An empty model, allocated directly on `device` in `dtype`: no float32 copy first, no random
    init (the loader fills every parameter). Stage 2 built in float32 on the CPU and then cast: 2x
    the memory for bfloat16, and a host-RAM copy of the whole model before a GPU ever saw it."""
    model_cls = get_model_class(cfg.architecture)
    with torch.device(device), default_dtype(dtype):
        model = model_cls(cfg)
    return model.eval()
