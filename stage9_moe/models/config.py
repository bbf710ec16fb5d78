"""The engine's own model config, read from a Hugging Face `config.json`.

One dataclass describes every family this stage runs (Llama, Qwen2, Qwen3, Mistral, and the
mixture-of-experts families Qwen3-MoE and Mixtral): they share one decoder and differ only in a few
flags. Reading config.json is where checkpoints silently go wrong, so `from_hf` refuses
(UnsupportedModelError, naming the key) anything it would otherwise ignore and get wrong: an unknown
RoPE scaling, a partial rotary, an activation other than SiLU, a MoE feature this stage does not
implement.

Two spellings of the RoPE settings exist in the wild, and both are read:

    transformers >= 5:  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor":
                        8.0, ...}
    classic (4.x, most Hub checkpoints):  "rope_theta": 500000.0,
                                          "rope_scaling": {"rope_type" or "type": "llama3",
                                              "factor": 8.0, ...}
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import RopeScaling


class UnsupportedModelError(ValueError):
    """The checkpoint needs a feature this stage does not implement (yet)."""


# RoPE variants this stage implements (layers.rope_inv_freq). Others (yarn, dynamic NTK, longrope)
# change more than the frequencies, so they are refused rather than approximated.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "default": (), "linear": ("factor", ),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # config.json "architectures"[0], the key of models.MODEL_REGISTRY
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    # key/value heads: < num_heads is grouped-query attention (GQA), 1 is multi-query
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3 / Mistral / SmolLM2 configs; else hidden_size // num_heads
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int  # the context length the engine allows (see sliding_window)
    tie_word_embeddings: bool  # lm_head reuses embed_tokens' matrix (SmolLM2, small Qwens)
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama when attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama when attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # recorded; the context is capped at it (see from_hf)
    dtype: str | None = None  # the checkpoint's own dtype ("bfloat16"), used by dtype="auto"
    # Mixture of experts (see parse_moe). num_experts == 0: a dense model, every layer has one MLP.
    # experts per MoE layer (Qwen3-MoE "num_experts", Mixtral "num_local_experts")
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: how many experts each token is sent to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (Mixtral: its intermediate_size)
    # rescale the k chosen probabilities to sum to 1 (Mixtral always does)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here (those keep a dense MLP)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Does layer `layer_id` route its tokens to experts? transformers' Qwen3MoeDecoderLayer
        rule."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Parse a config.json dict. Family-specific fixed features (Qwen2's bias, Qwen3's q/k norm)
        are not in the file: the family's model class adds them (models/qwen2.py,
        models/qwen3.py)."""
        archs = hf.get("architectures") or []
        if not archs:
            raise UnsupportedModelError(
                "config.json has no 'architectures' list: cannot tell which model it is")
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise UnsupportedModelError(
                f"hidden_act={act!r}: this stage's MLP is SwiGLU (silu) only")
        heads = hf["num_attention_heads"]
        # absent or null: one KV head per query head (MHA)
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        theta, scaling = parse_rope(hf)
        max_pos = hf.get("max_position_embeddings", 2048)
        window = _sliding_window(hf)
        if window is not None and window < max_pos:
            # No sliding-window attention here: within the window it equals full attention, so the
            # engine stays exact by never letting a sequence grow past it.
            max_pos = window
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
            **parse_moe(hf),
        )


def parse_rope(hf: dict) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) from either spelling; rope_parameters (transformers 5) wins when
    present."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    # per-layer-type RoPE (Gemma-style)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModelError(
            f"per-layer-type rope_parameters {sorted(rope)} are not supported")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {rope_type!r} is not supported; this stage implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial}: this stage rotates the whole head")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in rope]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} needs {missing} in config.json, got {rope}")
    known = {k: rope[k] for k in _ROPE_KEYS[rope_type]}
    return theta, RopeScaling(rope_type=rope_type, **known)


# MoE features of other families that change the computation; this stage implements none of them.
# Each key's value that means "not used": a config with any other value is refused, naming the key.
_UNSUPPORTED_MOE_KEYS = {
    # Qwen2-MoE: a shared expert every token also goes through
    "shared_expert_intermediate_size": 0,
    "n_shared_experts": 0, "num_shared_experts": 0,  # DeepSeek / others: shared experts
    "n_group": 1, "topk_group": 1,  # DeepSeek-V3: grouped top-k (choose groups of experts first)
    "scoring_func": "softmax",  # DeepSeek-V3: sigmoid router scores
    "routed_scaling_factor": 1.0,  # DeepSeek: scales the routed experts' sum
    # DeepSeek's spelling of which layers are dense
    "first_k_dense_replace": 0, "moe_layer_freq": 1,
}


def parse_moe(hf: dict) -> dict:
    """The MoE fields of ModelConfig, from either family's spelling ({} for a dense model).

        Qwen3-MoE (Hub):           "num_experts": 128, "num_experts_per_tok": 8,
                                   "moe_intermediate_size": 768, "norm_topk_prob": true,
                                   "decoder_sparse_step": 1, "mlp_only_layers": []
        Qwen3-MoE (transformers 5 save_pretrained): as above, "num_local_experts" for "num_experts"
        Mixtral:                   "num_local_experts": 8, "num_experts_per_tok": 2; each expert is
                                   intermediate_size wide; the top-2 are always renormalised
                                       (models/mixtral.py)
    """
    spellings = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k)}
    if len(set(spellings.values())) > 1:
        raise ValueError(f"config.json gives two different expert counts: {spellings}")
    num_experts = int(next(iter(spellings.values()), 0))
    if num_experts == 0:
        return {}
    for key, unused in _UNSUPPORTED_MOE_KEYS.items():
        if hf.get(key) not in (None, unused):
            raise UnsupportedModelError(
                f"{key}={hf[key]!r}: this stage's MoE layer has plain softmax top-k "
                f"routing over {num_experts} routed experts only")
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be an int in [1, {num_experts}], got {top_k!r}")
    step = hf.get("decoder_sparse_step", 1)
    step = 1 if step is None else step
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be an int >= 1, got {step!r}")
    dense = tuple(hf.get("mlp_only_layers") or ())
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < hf["num_hidden_layers"]]
    if bad:
        raise ValueError(
            f"mlp_only_layers {bad} are not layer indices of a {hf['num_hidden_layers']}-layer "
            "model"
        )
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), decoder_sparse_step=step,
                mlp_only_layers=dense)


def _sliding_window(hf: dict) -> int | None:
    """The attention window if any layer uses one. Mistral: "sliding_window" (null = none); Qwen2/3
    carry a sliding_window too but use it only with use_sliding_window=true."""
    window = hf.get("sliding_window")
    if window is None or ("use_sliding_window" in hf and not hf["use_sliding_window"]):
        return None
    return int(window)
