"""The Llama decoder: embed -> N x (attention + MLP, each with a pre-norm and a residual) -> norm ->
    lm_head.

Follow one forward pass top to bottom in `LlamaForCausalLM.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import ForwardBatch
from .layers import MLP, Attention, RMSNorm


class UnsupportedModelError(ValueError):
    """The checkpoint needs a feature this stage does not implement (yet)."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read the fields stage 2 understands from a config.json, refusing what it would silently
        get wrong."""
        arch = (hf.get("architectures") or ["?"])[0]
        if arch != "LlamaForCausalLM":
            raise UnsupportedModelError(
                f"stage 2 runs only LlamaForCausalLM, this checkpoint is {arch}")
        # transformers 5 keeps rope settings in "rope_parameters"; older configs use rope_theta /
        # rope_scaling.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise UnsupportedModelError(f"stage 2 has no RoPE scaling, this checkpoint uses {rope}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UnsupportedModelError("stage 2 has no attention/MLP bias")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(layer_id, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.rope_theta)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, fb)  # [N, hidden]
        x = x + self.mlp(self.post_attention_layernorm(x))  # [N, hidden]
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one matrix used both ways

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [N] packed tokens of B requests -> logits [B, vocab] of each one's
        last token."""
        x = self.embed_tokens(input_ids)  # [N, hidden]
        for layer in self.layers:
            x = layer(x, positions, fb)  # [N, hidden]
        # Only each request's last token predicts its next token: gather B rows before the big
        # LM-head matmul.
        x = x[fb.last_token_indices]  # [B, hidden]
        return self.lm_head(self.norm(x))  # [B, vocab]
