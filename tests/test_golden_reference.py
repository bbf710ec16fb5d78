"""The golden files cannot rot: transformers, run now on the same checkpoints, still produces them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from common.golden import GOLDEN_MODELS, TIE_MARGIN, compare, hf_reference, load_golden, load_hf_model, prompt_specs
from common.models import resolve_model


@pytest.mark.parametrize("model", GOLDEN_MODELS)
def test_golden_file_matches_transformers_now(model: str):
    golden = load_golden(model)
    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    specs = prompt_specs(tokenizer)
    assert [s["name"] for s in specs] == [c["name"] for c in golden["cases"]]
    hf_model = load_hf_model(path)
    for spec, case in zip(specs, golden["cases"]):
        assert spec["input_ids"] == case["input_ids"], f"{case['name']}: the tokenizer now encodes differently"
        ids, margins = hf_reference(hf_model, case["input_ids"], golden["max_new_tokens"])
        cmp = compare(ids, case["output_ids"], case["margins"])
        assert cmp.ok, f"{model}/{case['name']}: transformers no longer reproduces the golden file: {cmp.message}"
        n = min(len(margins), cmp.matched)
        assert margins[:n] == pytest.approx(case["margins"][:n], abs=1e-3)


@pytest.mark.parametrize("model", GOLDEN_MODELS)
def test_golden_prompts_cover_every_kind_of_input(model: str):
    golden = load_golden(model)
    cases = {c["name"]: c for c in golden["cases"]}
    assert set(cases) == {"english", "code", "chinese", "chat", "one_token", "long"}
    assert len(cases["one_token"]["input_ids"]) == 1
    assert len(cases["long"]["input_ids"]) >= 300
    assert any(ord(ch) > 0x3000 for ch in cases["chinese"]["prompt"])
    eos = json.loads((resolve_model(model) / "generation_config.json").read_text())["eos_token_id"]
    eos = {eos} if isinstance(eos, int) else set(eos)
    for case in cases.values():  # each reference runs to max_new_tokens or stops on EOS
        ids = case["output_ids"]
        assert len(ids) == golden["max_new_tokens"] or ids[-1] in eos, case["name"]
    # Reference outputs must be worth comparing: varied tokens, not one token repeated.
    for case in cases.values():
        assert len(set(case["output_ids"])) >= min(5, len(case["output_ids"])), case["name"]


def test_compare_rule():
    margins = [5.0, 5.0, TIE_MARGIN / 10, 5.0]
    assert compare([1, 2, 3, 4], [1, 2, 3, 4], margins).ok
    assert not compare([1, 9, 3, 4], [1, 2, 3, 4], margins).ok  # a real divergence
    tie = compare([1, 2, 7, 8], [1, 2, 3, 4], margins)
    assert tie.ok and tie.matched == 2  # divergence at a genuine tie is accepted
    assert not compare([1, 2], [1, 2, 3, 4], margins).ok  # stopped early
    assert not compare([1, 2, 3, 4, 5], [1, 2, 3, 4], margins).ok  # ran past the reference's stop
