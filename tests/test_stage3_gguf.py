"""Stage 3, part 3.7: a GGUF file as a checkpoint (stage3_weights/gguf_loader.py).

SmolLM2's Q4_1 GGUF must load into the golden weights (the golden reference ran transformers on
the same file dequantized); tiny checkpoints written as GGUF (common/gguf_files.py: llama.cpp's names and
q/k row order) must load into exactly the weights of their folder; bad files are refused with a
clear error before anything is loaded. The metadata folders are cached (gguf_loader.CACHE_DIR):
the first run converts each file's tokenizer (~10 s each).
"""

from __future__ import annotations

import pytest
import torch

from common.golden import load_golden
from common.gguf_files import tiny_gguf
from common.models import _find_gguf, resolve_model
from stage3_weights import LLM, SamplingParams
from stage3_weights import gguf_loader


def test_smollm2_gguf_loads_the_golden_weights():
    """The golden reference ran transformers on this file dequantized (common/models.py): the same
    weights, bit for bit, give its tokens (tests/test_golden.py runs them all on the folder)."""
    llm = LLM(str(_find_gguf()), verbose=False)
    assert llm.engine.load_stats.checkpoint_dtypes.keys() == {"Q4_1", "Q8_0", "F32"}
    folder = dict(LLM("smollm2-135m-instruct", verbose=False).engine.model.named_parameters())
    for name, param in llm.engine.model.named_parameters():
        assert torch.equal(folder[name], param), name
    golden = load_golden("smollm2-135m-instruct")
    case = golden["cases"][0]
    result = llm.generate([case["prompt"]], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert result.token_ids == case["output_ids"][:8]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])  # q/k rows permuted / not
def test_tiny_gguf_loads_the_folders_weights(model):
    from_gguf = LLM(str(tiny_gguf(model)), verbose=False).engine.model
    from_folder = LLM(str(resolve_model(model)), verbose=False).engine.model
    gguf_params = dict(from_gguf.named_parameters())
    for name, param in from_folder.named_parameters():
        assert torch.equal(gguf_params[name], param), name


def test_unsupported_tensor_type_is_named():
    path = tiny_gguf("tiny-qwen3", "Q5_0")
    with pytest.raises(ValueError, match=r"Q5_0.*supported: F32, F16, BF16, Q8_0, Q4_1"):
        LLM(str(path), verbose=False)


def test_truncated_or_corrupt_file_is_refused(tmp_path):
    data = tiny_gguf("tiny-qwen3").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        LLM(str(cut), verbose=False)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LLM(str(header_only), verbose=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(junk), verbose=False)


def test_names_are_checked_against_the_model(tmp_path):
    reader = gguf_loader.open_gguf(tiny_gguf("tiny-qwen3"))
    config = gguf_loader.hf_config(reader)
    model = LLM(str(resolve_model("tiny-llama")), verbose=False).engine.model  # 3 layers, not 2
    with pytest.raises(ValueError, match=r"missing .*model.layers.2.input_layernorm.*unexpected .*blk.0.attn_k_norm"):
        gguf_loader.plan_gguf(model, reader, config, tmp_path)
