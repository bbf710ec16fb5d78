"""Qwen2 = Llama + a bias on the q, k and v projections (never on o).

config.json does not say so: transformers' Qwen2Attention hard-codes bias=True for q/k/v, and so
does this class. Everything else (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings in the small sizes) is
the shared decoder.
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(replace(cfg, qkv_bias=True, o_bias=False))
