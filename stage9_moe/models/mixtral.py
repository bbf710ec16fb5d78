"""Mixtral = Mistral with a MoE block in every layer. What changes from Qwen3-MoE
(models/qwen3_moe.py):

- routing: the top-2 probabilities are always renormalised (transformers hard-codes it; config.json
  has no norm_topk_prob), and the routing weights stay float32 (no cast back to the model's dtype),
  so in bfloat16 each weighted expert output is computed in float32 before it is rounded;
- every layer is sparse (no decoder_sparse_step / mlp_only_layers), and each expert is
  intermediate_size wide;
- no q/k norms, no biases (Mistral's attention);
- checkpoint names: the block is `block_sparse_moe` and the experts' matrices are w1 (gate), w2
  (down), w3 (up):

    model.layers.{i}.block_sparse_moe.               ->  mlp.
      gate.weight                        [E, H]            gate.weight
      experts.{e}.w1.weight              [I, H]            experts.w13_weight[e, :I]
      experts.{e}.w3.weight              [I, H]            experts.w13_weight[e, I:]
      experts.{e}.w2.weight              [H, I]            experts.w2_weight[e]

  transformers 5 renames block_sparse_moe to mlp in memory, so its stacked layout is Qwen3-MoE's
  (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight).
"""

from __future__ import annotations

from dataclasses import replace

from ..distributed import SINGLE, TPInfo
from ..moe import moe_params_mapping
from .config import ModelConfig
from .mistral import MistralForCausalLM
from .qwen3_moe import Qwen3MoeSparseMoeBlock


class MixtralSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    weights_in_logits_dtype = False  # transformers' MixtralTopKRouter keeps them float32


class MixtralForCausalLM(MistralForCausalLM):
    moe_block = MixtralSparseMoeBlock

    def __init__(self, cfg: ModelConfig, tp: TPInfo = SINGLE):
        super().__init__(replace(cfg, norm_topk_prob=True), tp)

    def params_mapping(self, checkpoint_names) -> list[tuple[str, str, object]]:
        return moe_params_mapping(
            self, checkpoint_names, gate="w1", down="w2", up="w3",
            prefix=".block_sparse_moe.experts.", renames=[(".mlp.gate.weight",
                                                           ".block_sparse_moe.gate.weight", None)])
