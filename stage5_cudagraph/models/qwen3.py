"""Qwen3 = Llama + RMSNorm on each head of q and k, applied before RoPE (transformers'
Qwen3Attention: `q_norm(q_proj(x).view(..., head_dim))`), and no q/k/v bias (Qwen2's is gone) unless
`attention_bias` says so.

Its config.json also sets head_dim explicitly, and it need not equal hidden_size / num_heads
(Qwen3-0.6B: 1024 hidden, 16 heads, head_dim 128): ModelConfig already reads it, the shared decoder
already uses it.
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig
from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(replace(cfg, qk_norm=True))
