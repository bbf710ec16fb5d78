"""Qwen3-MoE = Qwen3 (q/k norms, GQA, RoPE) whose MLP, in its sparse layers, is a router and
experts.

    mlp.gate          [E, hidden]   the router: one logit per expert (replicated on every rank under
                                    TP)
    mlp.experts       E SwiGLU MLPs of width moe_intermediate_size, stacked in one FusedMoE (moe.py)

Routing, exactly as transformers' Qwen3MoeTopKRouter (dtype included): softmax of the logits in
float32, the num_experts_per_tok largest, renormalised to sum to 1 when norm_topk_prob
(Qwen3-30B-A3B: 8 of 128, true), then cast back to the model's dtype. Which layers are sparse:
config.json's decoder_sparse_step and mlp_only_layers (ModelConfig.is_moe_layer); the others keep
the dense MLP of intermediate_size.

Two checkpoint layouts are read. Published checkpoints (and transformers' default save_pretrained)
store each expert's matrices separately; transformers 5 stacks them in memory and writes them
stacked with save_pretrained(..., save_original_format=False):

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I, H]   ->  mlp.experts.w13_weight[e, :I]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight   [I, H]   ->  mlp.experts.w13_weight[e, I:]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight [H, I]   ->  mlp.experts.w2_weight[e]
    model.layers.{i}.mlp.experts.gate_up_proj      [E, 2I, H]  ->  mlp.experts.w13_weight (stacked)
    model.layers.{i}.mlp.experts.down_proj         [E, H, I]   ->  mlp.experts.w2_weight
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import SINGLE, TPInfo
from ..layers import ReplicatedLinear
from ..moe import FusedMoE, TopK, moe_params_mapping
from .config import ModelConfig
from .qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    # transformers' Qwen3MoeTopKRouter casts the top-k weights to the logits' dtype (Mixtral's does
    # not).
    weights_in_logits_dtype = True

    def __init__(self, cfg: ModelConfig, tp: TPInfo = SINGLE):
        super().__init__()
        self.tp = tp
        # the router: the same on every rank
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.topk = TopK(cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                         weights_in_logits_dtype=self.weights_in_logits_dtype)
        # Under TP each rank holds a slice of every expert's intermediate width (moe.py)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, tp_rank=tp.rank, tp_size=tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [N, E], in the model's dtype
        topk_output = self.topk(router_logits)  # [N, k] weights and expert ids
        # [N, hidden]: under TP, this rank's partial sum over its slices
        out = self.experts(x, topk_output)
        # the layer's one collective (SGLang: moe_tensor_model_parallel_all_reduce)
        return self.tp.all_reduce(out)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    moe_block = Qwen3MoeSparseMoeBlock

    def params_mapping(self, checkpoint_names) -> list[tuple[str, str, object]]:
        return moe_params_mapping(self, checkpoint_names, gate="gate_proj", down="down_proj",
                                  up="up_proj")
