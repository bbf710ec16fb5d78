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

Stage 7, tensor parallelism (Megatron-LM's scheme, SGLang's names): every big matrix is split over
tp_size ranks, and each rank computes with its slice. An attention block and an MLP each need just
ONE all-reduce:

    ColumnParallelLinear (qkv_proj, gate_up_proj)  output rows split: each rank gets its heads / its
                                                   slice of the intermediate size, and computes on
                                                       them
                                                   alone (no communication)
    RowParallelLinear    (o_proj, down_proj)       input columns split: each rank's product is a
                                                   partial sum, all-reduced into the full [N,
                                                       hidden]
    VocabParallelEmbedding, ParallelLMHead         vocabulary split: masked lookup + all-reduce;
                                                   logits all-gathered

With tp_size 1 (the default) nothing is split and no collective is called: the layers compute
exactly stage 6's.

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
from .distributed import SINGLE, TPInfo


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
    """After loading, on a CPU: pack every linear layer's weight (this rank's shard) in place of the
    plain one (the plain storage is freed). An untied LM head is packed the same way; a tied one
    gets a packed copy beside the embedding, which lookups still read plainly. Returns the number
    of weights packed."""
    linears = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    packed = 0
    for module in model.modules():
        if isinstance(module, linears) and can_pack(module.weight):
            module.weight = pack_weight(module.weight)
            packed += 1
    head = getattr(model, "lm_head", None)
    if type(head) is VocabParallelEmbedding and can_pack(head.weight):
        head.packed_weight = pack_weight(head.weight).data  # a buffer, not a second parameter
        packed += 1
    return packed


def copy_into(dst: torch.Tensor, loaded) -> None:
    """Copy a checkpoint tensor (or the lazily read slice of one, weights.LazyTensor) into (a slice
    of) a parameter, converting dtype and device on the way."""
    if dst.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.read())


def take_shard(loaded, dim: int, index: int, size: int, full: int):
    """Rows [index * size, (index + 1) * size) along dim of a checkpoint tensor that must be `full`
    long there. On a memory-mapped checkpoint only those rows are read."""
    if loaded.shape[dim] != full:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}: dim {dim} should be {full}")
    return loaded.narrow(dim, index * size, size)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A parameter stored whole in the checkpoint, under its own name (replicated on every rank)."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not merged, got shard_id={shard_id!r}")
    copy_into(param.data, loaded)


def _param(*shape: int) -> nn.Parameter:
    """An uninitialised inference parameter (the loader fills it), with the default loader
    attached."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


def _split(n: int, tp: TPInfo, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} {n} cannot be split over tp_size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over the ranks: rank r holds rows [r * out/tp,
    (r+1) * out/tp). Each rank computes its own slice of y; no communication (the next layer
    consumes the slice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPInfo = SINGLE):
        super().__init__()
        self.tp, self.in_features = tp, in_features
        self.out_features = _split(out_features, tp, "output size")  # this rank's rows
        self.weight = _param(self.out_features, in_features)
        self.bias = _param(self.out_features) if bias else None
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not merged, got shard_id={shard_id!r}")
        rows = param.shape[0]
        copy_into(param.data, take_shard(loaded, 0, self.tp.rank, rows, rows * self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # [N, out / tp]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears that read the same input, stacked along the output dim (stage
    3's merged linears). Every part is split over the ranks on its own: rank r holds its slice of
    each part, stacked.

    `output_sizes` maps each part's shard_id to its full width; `weight_loader(param, tensor,
    shard_id)` copies this rank's slice of one part into its rows (or its slice of the bias)."""

    def __init__(self, in_features: int, output_sizes: dict, bias: bool = False,
                 tp: TPInfo = SINGLE):
        # shard_id -> (first local row, local rows, which slice of the full part)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            local = _split(size, tp, f"{shard_id!r} output size")
            self.shard_offsets[shard_id] = (offset, local, tp.rank)
            offset += local
        super().__init__(in_features, offset * tp.size, bias, tp)
        # y.split(output_sizes, -1)
        self.output_sizes = [local for _, local, _ in self.shard_offsets.values()]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"unknown shard_id {shard_id!r}; this layer stacks {list(self.shard_offsets)}")
        start, local, index = self.shard_offsets[shard_id]
        part = take_shard(loaded, 0, index, local, local * self.full_rows(shard_id))
        copy_into(param.data.narrow(0, start, local), part)  # this rank's rows of the part

    def full_rows(self, shard_id) -> int:
        return self.tp.size  # each part is split evenly: full = local * tp


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections as one matmul: this rank's [(H + 2 * KVH) / tp * D, hidden], shards
    "q", "k", "v".

    Query heads are split over the ranks. KV heads too when there are at least as many as ranks;
    with fewer (Qwen3-32B has 8 KV heads: tp 16 would leave half a head per rank) each KV head is
    *replicated* on tp / KVH ranks, every rank holding the one KV head that its query heads
    share."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, tp: TPInfo = SINGLE):
        self.num_heads = _split(num_heads, tp, "num_attention_heads")  # this rank's query heads
        self.kv_replicas = max(1, tp.size // num_kv_heads)  # ranks that hold the same KV head
        self.num_kv_heads = max(1, num_kv_heads // tp.size)  # this rank's KV heads
        super().__init__(
            hidden_size, {
                "q": num_heads * head_dim, "k": self.num_kv_heads * head_dim * tp.size,
                "v": self.num_kv_heads * head_dim * tp.size
            }, bias, tp)
        for kv in ("k", "v"):  # which slice of the checkpoint's k/v rows this rank reads
            start, local, _ = self.shard_offsets[kv]
            self.shard_offsets[kv] = (start, local, tp.rank // self.kv_replicas)

    def full_rows(self, shard_id) -> int:
        return self.tp.size if shard_id == "q" else self.tp.size // self.kv_replicas


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's input columns split over the ranks: rank r holds columns [r * in/tp,
    ...), and its input is the slice the column-parallel layer before it produced. Each rank's
    product is a *partial sum* over its columns: one all-reduce adds them up (the only communication
    of an attention block or an MLP). The bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPInfo = SINGLE):
        super().__init__()
        self.tp, self.out_features = tp, out_features
        self.in_features = _split(in_features, tp, "input size")
        self.weight = _param(out_features, self.in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(out_features) if bias else None  # replicated

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not merged, got shard_id={shard_id!r}")
        cols = param.shape[1]
        copy_into(param.data, take_shard(loaded, 1, self.tp.rank, cols, cols * self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, out]: partial sums, then summed over ranks
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token id -> row of a [vocab, hidden] matrix, the vocabulary split over the ranks (padded to a
    multiple of tp): rank r holds ids [r * V/tp, (r+1) * V/tp). A rank looks up the ids it holds,
    writes zeros for the others, and an all-reduce assembles every row. With tied embeddings the LM
    head reuses this matrix (`logits`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPInfo = SINGLE):
        super().__init__()
        self.tp, self.num_embeddings = tp, num_embeddings
        self.rows = -(-num_embeddings // tp.size)  # this rank's share of the (padded) vocabulary
        self.start = tp.rank * self.rows
        self.weight = _param(self.rows, embedding_dim)
        self.weight.weight_loader = self.weight_loader
        # the LM head's copy of weight, when tied and packed (pack_linear_weights)
        self.register_buffer("packed_weight", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not merged, got shard_id={shard_id!r}")
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)}: dim 0 should be {self.num_embeddings}")
        # the last rank may hold padding rows
        real = max(0, min(self.rows, self.num_embeddings - self.start))
        param.data[real:].zero_()
        copy_into(param.data[:real], loaded.narrow(0, self.start, real))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # [N, hidden]
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)  # [N]: ids this rank holds
        # [N, hidden], zeros elsewhere
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine[:, None]
        return self.tp.all_reduce(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] -> [B, vocab]: each rank scores its share of the vocabulary, an all-gather
        joins them."""
        weight = self.weight if self.packed_weight is None else self.packed_weight
        return self.tp.all_gather(linear(x, weight))[:, : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocabulary split, its own [vocab, hidden] matrix; only `logits`
    is used."""
