"""Stage 3's bug-hunt checks beyond tests/exercises/stage3.py."""

from __future__ import annotations

import json

import torch

STAGE = "stage3_weights"


def test_eos_ids_are_read_from_every_source_and_form(stage, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128001}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128008, 128009]}))  # Llama-3.1 Instruct's
    assert stage.tokenizer.read_eos_token_ids(tmp_path) == {128001, 128008, 128009}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stage.tokenizer.read_eos_token_ids(tmp_path) == {128001, 7}


def test_rmsnorm_in_bfloat16_equals_transformers(stage):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = (torch.randn(64, 256) * 30).bfloat16()
    ours, theirs = stage.layers.RMSNorm(256, 1e-6), LlamaRMSNorm(256, 1e-6)
    weight = torch.rand(256) + 0.5
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    with torch.no_grad():  # both reduce in float32, then round to bfloat16 once: the same bits
        assert torch.equal(ours.bfloat16()(x), theirs.bfloat16()(x))
