"""The engine's own model config, read from a Hugging Face `config.json`.

One dataclass describes every family this stage runs (Llama, Qwen2, Qwen3, Mistral): they share one
decoder and differ only in a few flags. Reading config.json is where checkpoints silently go wrong,
so `from_hf` refuses (UnsupportedModelError, naming the key) anything it would otherwise ignore and
get wrong: an unknown RoPE scaling, a partial rotary, an activation other than SiLU.

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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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


def _sliding_window(hf: dict) -> int | None:
    """The attention window if any layer uses one. Mistral: "sliding_window" (null = none); Qwen2/3
    carry a sliding_window too but use it only with use_sliding_window=true."""
    window = hf.get("sliding_window")
    if window is None or ("use_sliding_window" in hf and not hf["use_sliding_window"]):
        return None
    return int(window)
