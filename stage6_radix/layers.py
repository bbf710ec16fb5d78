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

from . import kernels


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as Hugging Face does.

    With `residual` (SGLang's calling convention): add x to the residual stream first and return
    both, (rmsnorm(x + residual), x + residual), in one fused kernel on a GPU
    (kernels/triton_norm.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rmsnorm(x, self.weight, self.eps)
        return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)


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
        # positions: [N]; q: [N, H, D]; k: [N, KVH, D]. On a GPU one Triton kernel: angles computed
        # in registers, no cos/sin tables or rotate_half copies (kernels/triton_rope.py);
        # kernels/native.py is the torch version.
        return kernels.rotary_embedding(positions, q, k, self.inv_freq)


# On a CPU, torch hands a float32 matrix product to MKL, whose sgemm and sgemv take a slow generic
# path on some CPUs (measured on an AMD EPYC: 2-3x slower than oneDNN's AVX-512 kernels, for one
# row as for 512). oneDNN, which torch already uses for bfloat16, has fast kernels for both dtypes.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if torch.backends.mkldnn.is_available() else ()
# oneDNN computes fastest from a weight laid out in its own blocked format, chosen for an expected
# number of rows (any count works; 64 suits batch-1 decode and a full offline batch alike).
PACK_ROWS_HINT = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [N, in], W [out, in] (plain, or packed by pack_weight): on oneDNN on a
    CPU, else F.linear."""
    if weight.is_mkldnn or (x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES and x.dim() == 2):
        # graph.py's compiled decode: an operator inductor calls as it is
        if torch.compiler.is_compiling():
            return onednn_linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # [N, out]
    return F.linear(x, weight, bias)  # [N, out]


# Inductor rewrites oneDNN's linear only for weights it has frozen into constants; ours are the
# model's parameters, inputs of the compiled graph, so under torch.compile the call goes through an
# operator of our own, which inductor leaves alone. Defined with torch.library.Library rather than
# the @custom_op decorator: the decorator's wrapper cost ~7 us a call, this ~1.5 us (a batch-1
# decode step makes ~120 of them).
_PACKAGE = __name__.split(".")[0]  # each stage package registers its own operator
_LIB = torch.library.Library(_PACKAGE, "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("onednn_linear",
          lambda x, w, bias: torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], ""),
          "CompositeExplicitAutograd")
torch.library.register_fake(f"{_PACKAGE}::onednn_linear", lib=_LIB)(
    lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))
onednn_linear = getattr(torch.ops, _PACKAGE).onednn_linear  # x [N, in] -> [N, out]


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in ONEDNN_DTYPES and weight.dim() == 2


def pack_weight(weight: torch.Tensor) -> nn.Parameter:
    """A [out, in] weight reordered, once, into oneDNN's blocked layout. The result is an opaque
    tensor (layout torch._mkldnn) that only oneDNN's linear reads: the same values and products,
    without the kernel re-laying the plain matrix out on every call."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    return nn.Parameter(packed, requires_grad=False)


def pack_linear_weights(model: nn.Module) -> int:
    """After loading, on a CPU: pack every Linear's weight in place of the plain one (the plain
    storage is freed), and give a tied LM head a packed copy beside the embedding, which lookups
    still read plainly. Returns the number of weights packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and can_pack(module.weight):
            module.weight = pack_weight(module.weight)
            packed += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, Embedding) and can_pack(head.weight):
        head.packed_weight = pack_weight(head.weight).data  # a buffer, not a second parameter
        packed += 1
    return packed


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
        return linear(x, self.weight, self.bias)  # [N, out]


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
        # the LM head's copy of weight, when tied and packed (pack_linear_weights)
        self.register_buffer("packed_weight", None, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [N, hidden]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head: x [B, hidden] -> x E^T [B, vocab]."""
        return linear(x, self.weight if self.packed_weight is None else self.packed_weight)
