"""Every stage refuses a bad setup with an error that names the problem: a device this machine lacks, a checkpoint
without a tokenizer. And the process goes on working."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch

from common.golden import discover_stages


@pytest.mark.parametrize("stage_name", discover_stages())
def test_missing_or_unknown_device_is_a_clear_error(stage_name, tiny_llama_path):
    stage = importlib.import_module(stage_name)
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        stage.LLM(str(tiny_llama_path), device="gpu")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"device '{missing}' asked for"):
        stage.LLM(str(tiny_llama_path), device=missing)
    llm = stage.LLM(str(tiny_llama_path), device="cpu")  # and the same process goes on working
    assert len(llm.generate([[1, 2, 3]], stage.SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


@pytest.mark.parametrize("stage_name", discover_stages())
def test_checkpoint_without_tokenizer_is_a_clear_error(stage_name, tiny_llama_path, tmp_path):
    stage = importlib.import_module(stage_name)
    for f in tiny_llama_path.iterdir():  # weights and configs, no tokenizer files
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*tokenizer.json"):
        stage.LLM(str(tmp_path))
