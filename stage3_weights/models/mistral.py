"""Mistral = Llama, as far as this engine is concerned: same layers, no biases at all (transformers'
MistralAttention and MistralMLP hard-code bias=False), larger rope_theta and GQA, all read from
config.json.

What is Mistral-specific is the sliding window (Mistral-7B-v0.1: each token attends to the previous
4096 only). This stage has no windowed attention, so ModelConfig.from_hf caps the context at the
window instead: below it, windowed and full attention are the same computation, so every token we
produce is exact.
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(replace(cfg, qkv_bias=False, o_bias=False, mlp_bias=False))
