"""Quantized weights: a decode step reads every weight once, so fewer bytes per weight is more
tokens per second (--quantization, SGLang's flag).

At batch 1 a decode step is a pass over the weights: SmolLM2-135M in float32 is 538 MB per token,
in its GGUF's own blocks 92 MiB. Three schemes, each a `QuantizedWeight` in place of a linear
layer's float [out, in] weight:

    q4_1  llama.cpp's blocks of 32 weights along a row, 20 bytes each:
              | d fp16 | m fp16 | 16 bytes: weight j in the low nibble of byte j, j+16 in the high |
          weight = q * d + m, q in 0..15 (5 bits per weight)
    q8_0  34 bytes per 32 weights: | d fp16 | 32 x int8 q |, weight = q * d (8.5 bits per weight)
    int8  any float checkpoint: per output row r, scale[r] = max|W[r]| / 127, q = round(W / scale)

q4_1 and q8_0 are the blocks of a GGUF file kept as they are in memory (exactly what the float
loader dequantized: checked when they are attached); the tied embedding of a llama.cpp file is
q8_0 and stays so, for the lookup and the LM head. int8 is made here, from the float weights: lossy.

The reference matmul dequantizes the weight to float32 and multiplies (`quantized_linear_ref`);
the kernels (kernels/quant.py) compute the same numbers without the float matrix in memory.
q4_1_a8 / q8_0_a8 keep the same blocks and round each linear layer's input to int8 per block of 32
too, as llama.cpp does (part 9.12, kernels/quant_a8.py): lossy, faster on a CPU.
Not quantized: norms, biases, a MoE layer's experts and router; tp_size 1 only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

QUANT_METHODS = ("q4_1", "q8_0", "int8", "q4_1_a8", "q8_0_a8")
# kept as the file's own blocks; *_a8: activations rounded to int8 too (9.12, kernels/quant_a8.py)
GGUF_METHODS = {"q4_1": "Q4_1", "q8_0": "Q8_0", "q4_1_a8": "Q4_1", "q8_0_a8": "Q8_0"}
BLOCK = 32  # weights per block
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}


class QuantizationError(ValueError):
    """The quantization asked for does not fit the checkpoint."""


class QuantizedWeight(nn.Module):
    """A [out, in] weight held quantized. `data`: uint8 blocks [out, in / 32 * bytes per block]
    (q4_1, q8_0) or int8 [out, in]; `scales`: float32 [out] (int8 only). `dtype`: the model's,
    which products and looked-up rows are returned in."""

    def __init__(self, method: str, data: torch.Tensor, in_features: int,
                 scales: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, data.shape[0]
        self.dtype = dtype
        self.int8_activations = False  # part 9.12: x rounded to int8 per block (q4_1_a8, q8_0_a8)
        self.register_buffer("data", data.contiguous())
        self.register_buffer("scales", scales)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.method, self.data, self.scales)  # [out, in] float32

    def extra_repr(self) -> str:
        return f"{self.method}, out={self.out_features}, in={self.in_features}"


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian fp16) -> [..., 1] float32."""
    return two_bytes.contiguous().view(torch.float16).float()


def dequantize_q4_1(data: torch.Tensor) -> torch.Tensor:
    """uint8 [out, nb * 20] -> float32 [out, nb * 32]: q * d + m, rounded after the product and
    after the sum (as llama.cpp's and the gguf package's dequantizers)."""
    blocks = data.view(data.shape[0], -1, 20)  # [out, nb, 20]
    d, m, qs = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4]), blocks[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [out, nb, 32]: low nibbles first
    return (q * d + m).reshape(data.shape[0], -1)


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    """uint8 [out, nb * 34] -> float32 [out, nb * 32]: q * d."""
    blocks = data.view(data.shape[0], -1, 34)  # [out, nb, 34]
    d, q = _fp16(blocks[..., 0:2]), blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(data.shape[0], -1)


def dequantize(method: str, data: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    if method == "q4_1":
        return dequantize_q4_1(data)
    if method == "q8_0":
        return dequantize_q8_0(data)
    return data.float() * scales[:, None]  # int8: [out, in]


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Weight-only int8 with one scale per output row (symmetric: 0 stays 0)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return QuantizedWeight("int8", q, w.shape[1], scales, weight.dtype)


def quantized_linear_ref(x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: dequantize the whole weight to float32, then x W^T (+ b).
    [N, in] -> [N, out]"""
    return F.linear(x, weight.dequantize().to(x.dtype), bias)


# ----------------------------------------------------------------------------- attaching to a model
def linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every dense linear layer and the LM head (the tied one is the embedding).
    MoE experts and routers keep float weights."""
    from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding):
        found.append(("lm_head", head))
    return found


def check_quantization(method: str | None, model_path: Path, tp_size: int = 1) -> None:
    """Refuse, before anything is loaded, a quantization that does not fit the checkpoint: q4_1 /
    q8_0 need a GGUF file whose linear weights are those blocks; every scheme needs tp_size 1."""
    if method is None:
        return
    if method not in QUANT_METHODS:
        raise QuantizationError(f"unknown quantization {method!r}; choose one of "
                                f"{', '.join(QUANT_METHODS)}")
    if tp_size != 1:
        raise QuantizationError(f"quantization={method!r} runs with tp_size 1 only")
    from .gguf_loader import gguf_source, open_gguf

    source = gguf_source(model_path)
    if method not in GGUF_METHODS:
        return
    if source is None:
        raise QuantizationError(
            f"quantization={method!r} keeps a GGUF file's {GGUF_METHODS[method]} blocks, but "
            f"{model_path} is a safetensors folder; pass a .gguf file, or quantization='int8' "
            "(made from float weights)")
    wrong = [f"{t.name} ({t.tensor_type.name}, {int(t.shape[0])} per row)"
             for t in open_gguf(source).tensors
             if len(t.shape) == 2 and t.name.startswith("blk.")
             and t.tensor_type.name != GGUF_METHODS[method]]
    if wrong:
        raise QuantizationError(
            f"quantization={method!r} keeps {GGUF_METHODS[method]} blocks of 32 weights, but "
            f"{len(wrong)} linear weight(s) of {source.name} are not such blocks: "
            f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''} (a row length not a "
            "multiple of 32 cannot be; pass the quantization the file holds)")


def _block_plan(model: nn.Module, model_path: Path) -> tuple[dict, list]:
    """The model's config and [(GGUF tensor, module name, shard_id, checkpoint name)] of every
    tensor kept as blocks: a Q4_1/Q8_0 tensor that a linear layer (or tied LM head) loads."""
    from .gguf_loader import gguf_source, open_gguf, plan_gguf

    source = gguf_source(model_path)
    reader = open_gguf(source)
    config = json.loads((Path(model_path) / "config.json").read_text())
    plan = plan_gguf(model, reader, config, source)
    linear = {id(m) for _, m in linear_modules(model)}
    modules = dict(model.named_modules())
    kept = []
    for t in reader.tensors:
        if t.name not in plan or t.tensor_type.name not in GGUF_METHODS.values():
            continue
        param_name, shard_id, ckpt = plan[t.name]
        module_name = param_name.removesuffix(".weight")
        if id(modules[module_name]) in linear:
            kept.append((t, module_name, shard_id, ckpt))
    return config, kept


def gguf_block_tensors(model: nn.Module, model_path: Path, method: str | None) -> frozenset[str]:
    """The GGUF tensors that stay blocks under `method`: the float loader leaves them unread
    (weights.py), so the float weight of a quantized layer is never built."""
    if method not in GGUF_METHODS:
        return frozenset()
    return frozenset(t.name for t, *_ in _block_plan(model, model_path)[1])


def gguf_blocks(model: nn.Module, model_path: Path) -> dict[nn.Module, tuple[str, torch.Tensor]]:
    """{module: (method, uint8 blocks [out, bytes])} read from the GGUF file, each merged
    layer's parts stacked in its rows, llama.cpp's q/k row order undone (rows of blocks move
    whole)."""
    from .gguf_loader import permuted_heads, unpermute_rows

    config, kept = _block_plan(model, model_path)
    modules = dict(model.named_modules())
    parts: dict[str, list] = {}
    for t, module_name, shard_id, ckpt in kept:
        rows = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [out, bytes], a copy
        heads = permuted_heads(config, ckpt)
        if heads is not None:
            rows = unpermute_rows(rows, heads)
        module = modules[module_name]
        start = module.shard_offsets[shard_id][0] if shard_id is not None else 0
        parts.setdefault(module_name, []).append((start, t.tensor_type.name.lower(), rows))
    blocks = {}
    for name, pieces in parts.items():
        methods = {method for _, method, _ in pieces}
        if len(methods) > 1:
            raise QuantizationError(f"{name} merges parts of types {sorted(methods)}")
        stacked = torch.cat([rows for _, _, rows in sorted(pieces, key=lambda p: p[0])])
        blocks[modules[name]] = (methods.pop(), stacked)  # a tied LM head: the embedding's
    return blocks


def set_weight(module: nn.Module, weight: QuantizedWeight) -> None:
    """Put the quantized weight where the float parameter was (a tied LM head: the embedding
    too)."""
    del module.weight  # the float parameter
    module.weight = weight  # a submodule: its buffers move with the model and are counted
    if "packed_weight" in module._buffers:
        module.packed_weight = None


def quantize_model(model: nn.Module, method: str, model_path: Path) -> int:
    """Replace every linear layer's float weight by its quantized form: int8 from the loaded float
    weight; q4_1 / q8_0 from the file's blocks (the float weight was never loaded: engine.py skips
    those tensors). Returns the number of weights quantized."""
    from .kernels.quant import cpu_unavailable_reason

    cpu_unavailable_reason()  # builds the CPU kernels now (or learns why not), not mid-forward
    int8_activations = method.endswith("_a8")
    if int8_activations:  # part 9.12's kernels too (without them: x rounded, the exact paths)
        from .kernels.quant_a8 import load_cpu

        try:
            load_cpu()
        except RuntimeError:
            pass
    blocks = gguf_blocks(model, model_path) if method in GGUF_METHODS else {}
    count = 0
    for name, module in linear_modules(model):
        weight = module.weight.detach()
        if method == "int8":
            qweight = quantize_int8(weight)
        elif module in blocks:
            block_method, data = blocks[module]
            qweight = QuantizedWeight(block_method, data.to(weight.device), weight.shape[1],
                                      dtype=weight.dtype)
            if qweight.out_features != weight.shape[0]:
                raise QuantizationError(f"{name}: {qweight.out_features} rows of blocks for a "
                                        f"weight of {weight.shape[0]} rows")
        else:
            continue  # a float tensor in the file (checked by check_quantization for the layers)
        qweight.int8_activations = int8_activations
        set_weight(module, qweight)
        count += 1
    return count

