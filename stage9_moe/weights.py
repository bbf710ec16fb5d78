"""Load a Hugging Face safetensors checkpoint into the model: memory-mapped, shard by shard, tensor
by tensor.

    1. find the files   model.safetensors, or model.safetensors.index.json and the shards it lists
                        (a folder with only pytorch_model*.bin is refused: see BIN_ONLY_MESSAGE for
                            why)
    2. plan             read each file's header (names, shapes, dtypes; no weights), map every
                        checkpoint name to (our parameter, shard_id), and refuse the checkpoint,
                        naming names, if anything is missing, unexpected or the wrong shape, before
                        a single weight is read
    3. stream           for each tensor: out of the memory map -> converted to the model's dtype and
                        device -> into its parameter (or its rows of a merged one) by that
                        parameter's weight_loader

Peak memory is the model plus one tensor: the whole checkpoint is never in memory at once, and the
model was allocated directly in its final dtype and device (models.build_model).

Name mapping (SGLang's `stacked_params_mapping`, defined by the model class):

    model.layers.0.self_attn.k_proj.weight   ->  model.layers.0.self_attn.qkv_proj.weight, shard "k"
    model.layers.0.mlp.up_proj.weight        ->  model.layers.0.mlp.gate_up_proj.weight,   shard 1
    lm_head.weight (tied embeddings)         ->  skipped: lm_head *is* model.embed_tokens
    anything else                            ->  the parameter of the same name

MoE families (stage 9) map each expert's matrices into stacked parameters, with (expert_id, part)
shard ids:

    model.layers.0.mlp.experts.5.up_proj.weight  ->  model.layers.0.mlp.experts.w13_weight, shard
                                                     (5, "w3")

Their mapping depends on the checkpoint (experts stored one by one, or already stacked), so the
model gives it for the names it is shown: `model.params_mapping(checkpoint_names)`.
"""

from __future__ import annotations

import difflib
import json
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from .gguf_loader import gguf_source, load_gguf_weights
from .layers import default_weight_loader

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BIN_ONLY_MESSAGE = (
    "{path} holds only PyTorch pickle weights ({files}); this loader reads safetensors only. A "
    ".bin file is a "
    "Python pickle: unpickling can run code chosen by whoever made the file "
    "(torch.load(weights_only=True) "
    "narrows that, but has had bypasses), and it cannot be memory-mapped tensor by tensor. From a "
    "copy you "
    "trust, convert it once, e.g. with transformers: "
    "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)  (writes "
    "model.safetensors)."
)


class CheckpointError(ValueError):
    """The checkpoint folder does not fit the model: missing files, missing/unexpected tensors,
    wrong shapes."""


@dataclass
class LoadStats:
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0  # checkpoint bytes streamed (in the checkpoint's dtype)
    seconds: float = 0.0
    # bytes per dtype, e.g. {"bfloat16": 16_381_470_720}
    checkpoint_dtypes: Counter = field(default_factory=Counter)


def find_checkpoint_files(model_path: Path) -> list[Path]:
    """The safetensors files to read, refusing a folder whose index names files that are not
    there."""
    model_path = Path(model_path)
    index = model_path / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_path / f).is_file()]
        if missing:
            count = Counter(weight_map.values())
            lost = ", ".join(f"{f} ({count[f]} tensor{'s' * (count[f] > 1)})" for f in missing)
            raise CheckpointError(
                f"{model_path}: {INDEX_FILE} lists {len(files)} shard files, {len(missing)} of "
                f"them missing: {lost}. Download the checkpoint again.")
        return [model_path / f for f in files]
    if (model_path / SINGLE_FILE).is_file():
        # ignore other *.safetensors (e.g. Mistral's consolidated.safetensors)
        return [model_path / SINGLE_FILE]
    files = sorted(model_path.glob("*.safetensors"))
    if files:
        return files
    bins = sorted(p.name for p in model_path.glob("*.bin"))
    if bins:
        raise CheckpointError(BIN_ONLY_MESSAGE.format(path=model_path, files=", ".join(bins)))
    raise CheckpointError(
        f"no *.safetensors files in {model_path} (a config-only folder? load_format='dummy' runs "
        "it with random weights)")


def read_header(file: Path) -> dict[str, dict]:
    """A safetensors file's table of contents, in the order the tensors' bytes lie in the file (so
    streaming reads it front to back). Format: 8 bytes little-endian header length, then a JSON
    header {name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
    {...}}, then the bytes."""
    with open(file, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__", None)
    return dict(sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]))


Mapping = list[tuple[str, str, object]]  # (param_name fragment, checkpoint_name fragment, shard_id)


def expected_pieces(model: nn.Module, mapping: Mapping) -> dict[tuple[str, object], str]:
    """Every (parameter name, shard_id) the checkpoint must fill -> the checkpoint name that fills
    it."""
    pieces = {}
    # a tied lm_head shares embed_tokens' tensor: listed once
    for name, _ in model.named_parameters():
        stacked = [(p, c, s) for p, c, s in mapping if p in name]
        for param_frag, ckpt_frag, shard_id in stacked:
            pieces[(name, shard_id)] = name.replace(param_frag, ckpt_frag)
        if not stacked:
            pieces[(name, None)] = name
    return pieces


def map_name(mapping: Mapping, ckpt_name: str) -> tuple[str, object]:
    """Checkpoint tensor name -> (our parameter name, shard_id); shard_id None for a parameter
    stored whole. The first fragment that matches wins (MoE mappings list the experts' names before
    the dense ones)."""
    for param_frag, ckpt_frag, shard_id in mapping:
        if ckpt_frag in ckpt_name:
            return ckpt_name.replace(ckpt_frag, param_frag), shard_id
    return ckpt_name, None


def is_skipped(model: nn.Module, ckpt_name: str) -> bool:
    if model.config.tie_word_embeddings and ckpt_name == "lm_head.weight":
        # some tied checkpoints still store the (identical) matrix; ours is embed_tokens
        return True
    return ckpt_name.endswith(tuple(model.ignored_checkpoint_suffixes))


def plan_load(model: nn.Module,
              files: list[Path]) -> tuple[dict[tuple[Path, str], tuple[str, object]], int]:
    """Read only the headers: {(file, checkpoint name): (param name, shard_id)} in file order, and
    the bytes to stream. Raises CheckpointError naming every missing, unexpected or misshapen
    tensor."""
    headers = {file: read_header(file) for file in files}
    # The mapping may depend on the names (MoE: experts stored one by one, or stacked).
    mapping = model.params_mapping([name for header in headers.values() for name in header])
    pieces = expected_pieces(model, mapping)
    params = dict(model.named_parameters())
    plan: dict[tuple[Path, str], tuple[str, object]] = {}
    where: dict[str, str] = {}  # checkpoint name -> file it is in
    unexpected: list[str] = []
    total_bytes = 0
    for file, header in headers.items():
        for name, info in header.items():
            if name in where:
                raise CheckpointError(f"tensor {name!r} is in both {where[name]} and {file.name}")
            where[name] = file.name
            if is_skipped(model, name):
                continue
            target = map_name(mapping, name)
            if target not in pieces:
                unexpected.append(name)
                continue
            dry_run(params[target[0]], info["shape"], target, f"{name} in {file.name}")
            plan[file, name] = target
            total_bytes += info["data_offsets"][1] - info["data_offsets"][0]
    covered = set(plan.values())
    missing = [ckpt for piece, ckpt in pieces.items() if piece not in covered]
    if missing or unexpected:
        raise CheckpointError(mismatch_message(model, files[0].parent, missing, unexpected, where))
    return plan, total_bytes


def dry_run(param: nn.Parameter, shape: list[int], target: tuple[str, object], what: str) -> None:
    """Run the parameter's weight_loader on shape-only "meta" tensors: a wrong shape is refused from
    the header, before a byte of weights is read, by the same code that will do the real copy."""
    param_name, shard_id = target
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(torch.empty(param.shape, device="meta"), torch.empty(shape, device="meta"), shard_id)
    except ValueError as exc:
        shard = "" if shard_id is None else f" shard {shard_id!r}"
        raise CheckpointError(f"{what} -> {param_name}{shard}: {exc}") from None


def mismatch_message(model: nn.Module, path: Path, missing: list[str], unexpected: list[str],
                     where: dict[str, str]) -> str:
    arch = type(model).__name__

    def some(names: list[str], with_file: bool = False) -> str:
        shown = [f"{n} ({where[n]})" if with_file else n for n in sorted(names)[:8]]
        return ", ".join(shown) + (f", ... and {len(names) - 8} more" if len(names) > 8 else "")

    parts = [f"checkpoint {path} does not match {arch}:"]
    if missing:
        parts.append(f"{len(missing)} missing tensor(s): {some(missing)}.")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensor(s): {some(unexpected, with_file=True)}.")
    hint = prefix_hint(missing, unexpected)
    if hint is None:  # a renamed tensor or two: point at the likely pairs
        pairs = [(u, difflib.get_close_matches(u, missing, n=1, cutoff=0.8))
                 for u in sorted(unexpected)[:3]]
        close = [f"{u!r} looks like {m[0]!r}" for u, m in pairs if m]
        hint = f"Renamed tensors? {'; '.join(close)}." if close else None
    return " ".join(parts + ([hint] if hint else []))


def prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """Detect the common whole-checkpoint mistake: every name off by the same leading prefix."""
    votes: Counter = Counter()
    missing_set, unexpected_set = set(missing), set(unexpected)
    for names, others, kind in ((unexpected, missing_set, "extra"), (missing, unexpected_set,
                                                                     "lacks")):
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts)):
                if ".".join(parts[i:]) in others:
                    votes[(kind, ".".join(parts[:i]) + ".")] += 1
                    break
    if not votes:
        return None
    (kind, prefix), n = votes.most_common(1)[0]
    if n < max(1, len(unexpected) // 2):
        return None
    if kind == "extra":
        return (
            f"Prefix mismatch: {n} checkpoint names carry an extra leading {prefix!r} (saved from "
            "a wrapper "
            f"such as DDP or PEFT?); strip it from the names."
        )
    return (
        f"Prefix mismatch: {n} checkpoint names lack the leading {prefix!r} (saved from the bare "
        "decoder, "
        f"e.g. LlamaModel, rather than ...ForCausalLM?)."
    )


class LazyTensor:
    """A checkpoint tensor not read yet: `narrow` picks rows or columns, `read` reads only those
    from the memory map. Tensor parallelism's weight loaders take their shard this way, so no rank
    ever reads a whole matrix it holds only a slice of. `reads` counts (dtype, bytes) of what was
    read, for the load statistics."""

    def __init__(self, file_slice, shape, reads: list, index: tuple = ()):
        self.file_slice, self.shape, self.reads, self.index = file_slice, torch.Size(
            shape), reads, index

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        index = list(self.index) + [slice(None)] * (len(self.shape) - len(self.index))
        base = index[dim].start or 0
        index[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return LazyTensor(self.file_slice, shape, self.reads, tuple(index))

    def read(self) -> torch.Tensor:
        tensor = self.file_slice[self.index] if self.index else self.file_slice[:]
        self.reads.append(
            (str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()))
        return tensor


def load_weights(model: nn.Module, model_path: Path, progress: bool | None = None,
                 skip_gguf: frozenset[str] = frozenset()) -> LoadStats:
    """Fill every parameter of `model` (this rank's shard of it) from the checkpoint folder.
    progress: show a tqdm bar (None: if stderr is a terminal). skip_gguf: tensors of a GGUF file
    left unread (stage 9's quantized weights, read as blocks by quantization.py)."""
    if gguf_source(model_path) is not None:  # a GGUF file's metadata folder: its own loader
        return load_gguf_weights(model, Path(model_path), LoadStats(), skip_gguf)
    start = time.perf_counter()
    files = find_checkpoint_files(Path(model_path))
    plan, total_bytes = plan_load(model, files)
    params = dict(model.named_parameters())
    stats = LoadStats(files=len(files))
    show = sys.stderr.isatty() if progress is None else progress
    shapes = {file: {n: info["shape"] for n, info in read_header(file).items()} for file in files}
    with tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not show,
              desc=f"Loading {len(files)} safetensors file(s)") as bar:
        for file, name in plan:  # file order: each file is read front to back
            param_name, shard_id = plan[file, name]
            param = params[param_name]
            # safe_open memory-maps the file and get_slice reads nothing: the weight loader reads
            # only this rank's rows. Those pages stay in our resident memory until the map is
            # closed, so one map per tensor (a header parse: microseconds) keeps the peak at model +
            # one tensor instead of model + the whole file.
            reads: list[tuple[str, int]] = []
            with safe_open(str(file), framework="pt", device="cpu") as f:
                lazy = LazyTensor(f.get_slice(name), shapes[file][name], reads)
                # plain params: whole copy
                loader = getattr(param, "weight_loader", default_weight_loader)
                # converts dtype/device as it copies; shapes were checked
                loader(param, lazy, shard_id)
                del lazy  # the last reference to the map's pages
            for dtype, nbytes in reads:
                stats.checkpoint_dtypes[dtype] += nbytes
                stats.bytes_read += nbytes
                bar.update(nbytes)
            stats.tensors += 1
    stats.seconds = time.perf_counter() - start
    return stats


def load_dummy_weights(model: nn.Module, seed: int = 0) -> LoadStats:
    """SGLang's --load-format dummy: random weights from the config alone, so a model's real shapes
    run without a checkpoint on disk. Each checkpoint tensor is drawn whole from a generator seeded
    by its name, then handed to the same weight loaders as a real file's: every tp_size gets the
    same model, sliced its way. The scales keep greedy decoding decisive (logits spread by ~16,
    activations bounded), as the course's tiny checkpoints do."""
    start = time.perf_counter()
    params = dict(model.named_parameters())
    stats = LoadStats(files=0)
    shapes = checkpoint_shapes(model)
    device = next(model.parameters()).device
    layers = model.config.num_layers
    for (param_name, shard_id), ckpt_name in expected_pieces(model,
                                                             model.params_mapping([])).items():
        shape = shapes[ckpt_name]
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 +
                                                         zlib.crc32(ckpt_name.encode()))
        tensor = torch.randn(shape, generator=gen,
                             device=device, dtype=torch.float32) * _dummy_scale(
                                 ckpt_name, shape, model.config.hidden_size, layers)
        if ckpt_name.endswith("norm.weight") and ckpt_name != "model.norm.weight":
            tensor += 1.0  # a gain around 1
        param = params[param_name]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
        stats.tensors += 1
        del tensor
    stats.seconds = time.perf_counter() - start
    return stats


def _dummy_scale(name: str, shape, hidden: int, layers: int) -> float:
    if name == "model.norm.weight":
        return 16.0 / hidden**0.5  # the final norm sets the logits' spread
    if name.endswith("norm.weight"):
        return 0.2
    if "embed_tokens" in name or name.startswith("lm_head"):
        return 1.0
    if name.endswith(".bias"):
        return 0.5
    fan_in = shape[-1]  # a matrix's input width (also for an expert's, one of E stacked ones)
    # what a layer writes into the residual
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return 6.0 / fan_in**0.5 / max(1.0, layers / 2) ** 0.5
    return 1.5 / fan_in**0.5


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's full (unsharded) shape, read off a tp_size 1 copy of the model
    built on the meta device (no memory): a merged parameter's parts have the widths its
    shard_offsets say."""
    # here: models imports weights' neighbours, not the other way round
    from .models import get_model_class

    with torch.device("meta"):
        full = get_model_class(model.config.architecture)(model.config)
    modules = dict(full.named_modules())
    shapes = {}
    for (param_name, shard_id), ckpt_name in expected_pieces(full, full.params_mapping([])).items():
        param, module = full.get_parameter(param_name), modules[param_name.rsplit(".", 1)[0]]
        if shard_id is None:
            shapes[ckpt_name] = tuple(param.shape)
        elif hasattr(module, "checkpoint_shape"):  # stage 9: an expert's matrix (moe.FusedMoE)
            shapes[ckpt_name] = module.checkpoint_shape(shard_id)
        else:
            _, rows, _ = module.shard_offsets[shard_id]
            shapes[ckpt_name] = (rows, *param.shape[1:])
    return shapes
