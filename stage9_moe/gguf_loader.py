"""GGUF files: config, tokenizer and tensors from one file (llama.cpp's format).

A GGUF file holds what a Hugging Face folder spreads over several files: metadata key/values (the
config and the tokenizer's vocabulary, merges and chat template) and the tensors, often quantized
in llama.cpp's 32-weight blocks. `LLM("model.gguf")` runs it:

    1. check       the header: magic, every tensor's type is one we read, every tensor's bytes lie
                   inside the file (a truncated download is refused before anything is loaded)
    2. unpack      the metadata into a small folder (config.json, generation_config.json, tokenizer
                   files: `gguf_folder`), so the rest of the engine reads a checkpoint folder as
                   always; config.json's "gguf_file" points back at the file for the weights
    3. load        each tensor: GGUF name -> checkpoint name (blk.3.attn_q.weight ->
                   model.layers.3.self_attn.q_proj.weight), dequantized to float32, llama.cpp's
                   q/k row permutation undone, then the parameter's own weight_loader, as the
                   safetensors loader does; every name is checked against the model first

This stage keeps float weights (the blocks are dequantized on load); keeping them quantized is a
later lesson (stage 9, --quantization). The metadata folder is cached by file (path, size, mtime).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

GGUF_MAGIC = b"GGUF"
# Tensor types this engine reads (dequantizing the quantized ones).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_1")
# GGUF architecture -> (config.json "architectures", model_type)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
             "model.norm.weight", "output.weight": "lm_head.weight"}
CACHE_DIR = Path(os.environ.get("SGLZ_CACHE", "~/.cache/sglang-from-zero")).expanduser() / "gguf"


class GGUFError(ValueError):
    """The GGUF file cannot be run: unreadable, truncated, or holding what this engine lacks."""


def is_gguf(path: str | os.PathLike) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".gguf"


def open_gguf(path: Path):
    """A gguf.GGUFReader over the file (memory-mapped: no tensor is read), after checking that it is
    a whole GGUF file whose tensors all have a type this engine reads. Parsing the header takes
    seconds (the vocabulary is ~100k small fields), so the last reader is kept."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf(path: Path, size: int, mtime_ns: int):
    import gguf

    with open(path, "rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no 'GGUF' magic at its start)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader fails in numpy or struct on a cut header
        raise GGUFError(
            f"{path} is truncated or corrupt: its header cannot be read ({exc})") from None
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which this "
                            f"engine does not implement; supported: {', '.join(SUPPORTED_TYPES)}")
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path} is truncated: tensor {t.name} ends at byte "
                            f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader) -> dict:
    """config.json's keys from the GGUF metadata (llama.cpp's `{arch}.*` keys)."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; this loader reads "
                        f"{', '.join(ARCHITECTURES)}")
    if field_value(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise GGUFError(f"GGUF rope scaling {field_value(reader, f'{arch}.rope.scaling.type')!r} "
                        "is not supported by this loader")
    names = {t.name for t in reader.tensors}
    eps = field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    heads = int(field_value(reader, f"{arch}.attention.head_count"))
    hidden = int(field_value(reader, f"{arch}.embedding_length"))
    head_dim = field_value(reader, f"{arch}.attention.key_length",
                           field_value(reader, f"{arch}.rope.dimension_count", hidden // heads))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    cfg = {
        "architectures": [ARCHITECTURES[arch][0]], "model_type": ARCHITECTURES[arch][1],
        "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": int(field_value(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field_value(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field_value(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(field_value(reader, f"{arch}.context_length")),
        # stored as float32: 1e-5 reads back as 9.99999974e-06, hence 6 digits
        "rms_norm_eps": float(f"{eps:.6g}"),
        "rope_theta": float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(field_value(reader, f"{arch}.vocab_size", len(tokens.data))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in names,
        "bos_token_id": bos, "eos_token_id": eos, "dtype": "float32",
    }
    return cfg


def gguf_folder(path: str | os.PathLike) -> Path:
    """The metadata folder of a GGUF file (made once, then cached): config.json with "gguf_file",
    generation_config.json, and the tokenizer files written by transformers' GGUF tokenizer
    support."""
    path = Path(path).expanduser().resolve()
    reader = open_gguf(path)
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = CACHE_DIR / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    cfg = hf_config(reader)
    cfg["gguf_file"] = str(path)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.model_max_length = cfg["max_position_embeddings"]
    tokenizer.save_pretrained(tmp)
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if folder.exists():  # another process made it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(folder)
    return folder


def gguf_source(model_path: Path) -> Path | None:
    """The GGUF file behind a metadata folder made by gguf_folder, or None for a plain folder."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    source = json.loads(config.read_text()).get("gguf_file")
    return Path(source) if source else None


def checkpoint_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face checkpoint name (None: unknown)."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    return None


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. Its converter reorders each head's rows from RoPE's
    halves (x_i, x_{i+D/2}) to interleaved pairs (x_2i, x_2i+1), the layout its own rope reads; we
    rotate halves, as transformers does. Works on float rows and on rows of quantized blocks alike
    (a block never spans two rows)."""
    shape = rows.shape
    pairs = rows.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])  # [H, D/2, 2, ...]
    return pairs.transpose(1, 2).reshape(shape)  # [H, 2, D/2, ...]: the halves


def permuted_heads(config: dict, ckpt_name: str) -> int | None:
    """Heads whose rows llama.cpp permuted in this tensor (llama family q and k), else None."""
    if config["model_type"] != "llama":
        return None
    if ckpt_name.endswith("q_proj.weight") or ckpt_name.endswith("q_proj.bias"):
        return config["num_attention_heads"]
    if ckpt_name.endswith("k_proj.weight") or ckpt_name.endswith("k_proj.bias"):
        return config["num_key_value_heads"]
    return None


def dequantize(tensor) -> torch.Tensor:
    """A GGUF tensor as float32 [rows, cols] (GGUF lists dims fastest first: reversed here)."""
    import gguf

    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = [int(d) for d in reversed(tensor.shape)]
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a writable copy


def plan_gguf(model: nn.Module, reader, config: dict, path: Path) -> dict:
    """{GGUF tensor: (param name, shard_id, checkpoint name)}, refusing missing or unexpected names
    before any weight is read, as the safetensors loader does."""
    names = {t.name: checkpoint_name(t.name) for t in reader.tensors}
    unknown = sorted(n for n, c in names.items() if c is None)
    ckpt_names = [c for c in names.values() if c is not None]
    # stage 9 models choose their mapping by the names they are shown; earlier ones have one
    mapping = (model.params_mapping(ckpt_names) if hasattr(model, "params_mapping")
               else model.stacked_params_mapping)
    params = dict(model.named_parameters())
    expected = {}
    for name in params:
        stacked = [(p, c, s) for p, c, s in mapping if p in name]
        for frag, ckpt_frag, shard_id in stacked:
            expected[name.replace(frag, ckpt_frag)] = (name, shard_id)
        if not stacked:
            expected[name] = (name, None)
    plan, unexpected = {}, list(unknown)
    for t in reader.tensors:
        ckpt = names[t.name]
        if ckpt is None or (config["tie_word_embeddings"] and ckpt == "lm_head.weight"):
            continue
        if ckpt not in expected:
            unexpected.append(t.name)
            continue
        plan[t.name] = (*expected[ckpt], ckpt)
    missing = sorted(set(expected) - {c for *_, c in plan.values()})
    if missing or unexpected:
        raise GGUFError(f"{path} does not match {type(model).__name__}: missing "
                        f"{missing[:8] or 'none'}, unexpected {sorted(unexpected)[:8] or 'none'}")
    return plan


def load_gguf_weights(model: nn.Module, model_path: Path, stats,
                      skip: frozenset[str] = frozenset()) -> object:
    """Fill every parameter of `model` from the GGUF file behind `model_path` (a gguf_folder).
    `stats` is the caller's LoadStats, filled and returned. `skip`: GGUF tensors left unread (stage
    9: quantized weights kept as the file's blocks, never dequantized; quantization.py)."""
    from .layers import default_weight_loader

    start = time.perf_counter()
    path = gguf_source(model_path)
    reader = open_gguf(path)
    config = json.loads((Path(model_path) / "config.json").read_text())
    plan = plan_gguf(model, reader, config, path)
    params = dict(model.named_parameters())
    stats.files = 1
    for t in reader.tensors:
        if t.name not in plan or t.name in skip:
            continue
        param_name, shard_id, ckpt = plan[t.name]
        tensor = dequantize(t)  # [out, in] float32
        heads = permuted_heads(config, ckpt)
        if heads is not None:
            tensor = unpermute_rows(tensor, heads)
        param = params[param_name]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
        stats.tensors += 1
        stats.bytes_read += int(t.n_bytes)
        stats.checkpoint_dtypes[t.tensor_type.name] += int(t.n_bytes)
    stats.seconds = time.perf_counter() - start
    return stats
