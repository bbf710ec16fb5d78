"""The decoder every family of this stage shares. Qwen2, Qwen3 and Mistral are this code with a flag
or two (models/qwen2.py, qwen3.py, mistral.py). Read it top to bottom: attention, MLP, one layer,
the stack, the head.

    LlamaForCausalLM
      model: LlamaModel
        embed_tokens                       [vocab, hidden]
        layers[i]: LlamaDecoderLayer
          input_layernorm                  RMSNorm
          self_attn: LlamaAttention        qkv_proj (merged), q_norm/k_norm (Qwen3), rotary_emb,
                                           o_proj
          post_attention_layernorm         RMSNorm
          mlp: LlamaMLP                    gate_up_proj (merged), down_proj
        norm                               RMSNorm
      lm_head                              [vocab, hidden], or embed_tokens itself when tied

Parameter names are the checkpoint's ("model.layers.0.self_attn.o_proj.weight"), except the two
merged layers, which `stacked_params_mapping` describes to the loader (weights.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..attention import ForwardBatch
from ..layers import Embedding, Linear, MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding
from .config import ModelConfig


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: one merged q/k/v matmul, RoPE, then the attention backend
    (which also writes this pass's K/V into the cache)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  bias=cfg.qkv_bias)
        # Qwen3 normalises each head of q and k (RMSNorm over D, one weight shared by all heads)
        # before RoPE: it keeps attention logits from growing without bound.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        N = x.shape[0]  # x: [N, hidden], the packed tokens of every request in the batch
        qkv = self.qkv_proj(x)  # [N, (H + 2*KVH) * D]: one matmul instead of three
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)  # views, no copy
        q = q.view(N, self.num_heads, self.head_dim)  # [N, H, D]
        k = k.view(N, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        v = v.view(N, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        # positions are per request, so RoPE needs nothing else
        if self.q_norm is None:
            q, k = self.rotary_emb(positions, q, k)
        else:  # Qwen3: each head normalised (a mean over D only), then RoPE; one kernel on a GPU
            q, k = kernels.qk_norm_rope(positions, q, k, self.q_norm.weight, self.k_norm.weight,
                                        self.q_norm.eps, self.rotary_emb.inv_freq)

        # The backend stores K/V in the cache and attends: varlen over the prompts (prefill), or one
        # query per request against its cache row (decode).
        out = fb.attn_backend.forward(q, k, v, self.layer_id, fb)  # [N, H, D]
        return self.o_proj(out.reshape(N, self.num_heads * self.head_dim))  # [N, hidden]


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up computed by one merged matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {0: inter, 1: inter}, bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2 * inter]: gate | up
        return self.down_proj(kernels.silu_and_mul(gate_up))  # [N, hidden]


class LlamaDecoderLayer(nn.Module):
    """Attention and MLP, each behind an RMSNorm and added to the residual stream.

    SGLang's form, which lets each add be fused into the norm that follows it
    (kernels.fused_add_rmsnorm): a layer takes and returns (hidden, residual), and the add of its
    output happens in the next norm."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the residual stream is the embedding itself
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            # residual += previous layer's MLP output
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, fb)  # [N, hidden]
        # residual += attention output
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual  # [N, hidden] each


class LlamaModel(nn.Module):
    """embed -> N x decoder layer -> final norm: the "model." part of checkpoint names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.embed_tokens(input_ids), None  # [N, hidden]
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, fb)
        # The last MLP output is not added yet: the caller's final norm does it, fused, on the rows
        # it keeps.
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor name fragment -> (our merged parameter's fragment, shard_id), as in SGLang's
    # load_weights.
    stacked_params_mapping = [
        # (param_name, checkpoint_name, shard_id)
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    # Tensors some checkpoints carry that the model recomputes itself (old Llama exports saved
    # RoPE's inv_freq).
    ignored_checkpoint_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:
            # one [vocab, hidden] matrix used both ways, stored once
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [N] packed tokens of B requests -> logits [B, vocab] of each one's
        last token."""
        hidden, residual = self.model(input_ids, positions, fb)  # [N, hidden] each
        # Only each request's last token predicts its next token: gather B rows before the big
        # LM-head matmul.
        last = fb.last_token_indices
        # [B, hidden]: the last add, fused into the norm
        x, _ = self.model.norm(hidden[last], residual[last])
        # Sampling reads float32 logits whatever the weights' dtype (as transformers' generate
        # does): a bfloat16 logit has 8 bits of mantissa, too few to tell close candidates apart in
        # a softmax.
        head = self.lm_head
        return (head.logits(x) if isinstance(head, Embedding) else head(x)).float()  # [B, vocab]
