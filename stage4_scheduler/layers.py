"""The building blocks every model family shares: norms, rotary embedding, embedding and linear
layers.

Shapes use: N = tokens in this forward pass (all requests of the batch, packed), H = query heads,
KVH = key/value heads (GQA: H is a multiple of KVH), D = head_dim.

New in stage 3: linear layers that own their loading. Every parameter carries a
`weight_loader(param, tensor, shard_id)` (SGLang's convention), so the checkpoint loader never needs
to know a layer's layout. That is what lets two layers stop mirroring the checkpoint one to one:

    q_proj, k_proj, v_proj (3 matmuls) -> qkv_proj      [q + 2 kv, hidden], shard_id "q" / "k" / "v"
    gate_proj, up_proj     (2 matmuls) -> gate_up_proj  [2 * inter, hidden], shard_id 0 / 1

All three projections read the same input, so one matmul over the stacked weight computes them
together: fewer kernel launches and a larger, more efficient GEMM (the input is read once). The
output is split afterwards.

Parameters are created with torch.empty, not initialised: the loader overwrites every one of them,
and checks that it did, so random init would only cost time (seconds for a large model on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as Hugging Face does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long context. rope_type "default" means no
    stretching."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    # llama3 only: the context the model was pre-trained on
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotation speed of each of the D/2 dimension pairs, float32 [D/2] (transformers' formulas,
    exactly).

    Pair i turns by position * inv_freq[i] radians: pair 0 fastest (wavelength 2*pi tokens), the
    last pair slowest (wavelength ~2*pi*theta). Scaling slows the slow pairs down so that a longer
    context stays in the range of angles the model saw in training:
      linear: every pair slowed by `factor`. llama3: pairs whose wavelength is short next to the
      pre-training context (local detail, < orig/high_freq)
              unchanged; long ones (> orig/low_freq) slowed by `factor`; those in between blended
              smoothly.
    """
    scaling = scaling or RopeScaling()
    # on the CPU: same bits everywhere
    dims = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (dims / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        orig, factor = scaling.original_max_position_embeddings, scaling.factor
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq  # [D/2] tokens per full turn
        # long wavelengths: slowed
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        # 0 at wavelen = orig/low .. 1 at wavelen = orig/high
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        return torch.where(is_medium, blended, scaled)
    assert scaling.rope_type == "default", scaling  # ModelConfig.from_hf refuses the others
    return inv_freq


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each (x_i, x_{i+D/2}) pair of q and k by an angle position * inv_freq[i].

    Attention scores q.k then depend only on the distance between two positions. inv_freq and the
    angles stay in float32 whatever the model's dtype (a bfloat16 inv_freq would be off by up to
    0.4%, i.e. radians of error by position ~1000); only cos/sin are cast, as transformers does.
    """

    def __init__(self, head_dim: int, rope_theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        # Built under `with torch.device(...)` (engine.build_model): move to that device, keep
        # float32.
        inv_freq = rope_inv_freq(head_dim, rope_theta, scaling).to(torch.get_default_device())
        # [D/2], float32, not in checkpoints
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [N]; q: [N, H, D]; k: [N, KVH, D]
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos = emb.cos().to(q.dtype)[:, None, :]  # [N, 1, D], broadcast over heads
        sin = emb.sin().to(q.dtype)[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def copy_into(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, converting dtype and device on the
    way."""
    if dst.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A parameter stored whole in the checkpoint, under its own name."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not merged, got shard_id={shard_id!r}")
    copy_into(param.data, loaded)


def _param(*shape: int) -> nn.Parameter:
    """An uninitialised inference parameter (the loader fills it), with the default loader
    attached."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class Linear(nn.Module):
    """y = x W^T (+ b), W: [out, in], stored whole in the checkpoint (o_proj, down_proj,
    lm_head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [N, out]


class MergedLinear(Linear):
    """Several linears that read the same input, stacked along the output dim into one weight.

    `output_sizes` maps each part's shard_id to its width. The checkpoint stores the parts as
    separate tensors; `weight_loader(param, tensor, shard_id)` copies one of them into its rows (or
    its slice of the bias).
    """

    def __init__(self, in_features: int, output_sizes: dict, bias: bool = False):
        super().__init__(in_features, sum(output_sizes.values()), bias)
        # for splitting the output: y.split(output_sizes, -1)
        self.output_sizes = list(output_sizes.values())
        self.shard_offsets: dict = {}  # shard_id -> (first row, rows)
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"unknown shard_id {shard_id!r}; this layer stacks {list(self.shard_offsets)}")
        start, size = self.shard_offsets[shard_id]
        copy_into(param.data.narrow(0, start, size), loaded)  # rows [start, start + size)


class QKVLinear(MergedLinear):
    """q, k and v projections as one matmul: weight [(H + 2*KVH) * D, hidden], shards "q", "k",
    "v"."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False):
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, bias)


class Embedding(nn.Module):
    """Token id -> row of a [vocab, hidden] matrix. With tied embeddings the LM head reuses this
    matrix."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = _param(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [N, hidden]
