"""The golden-output harness: every stage, through the common API, against Hugging Face's greedy outputs.

Nothing here is stage-specific: a stage joins by existing. A stage that does not support a checkpoint's
architecture yet says so by raising its UnsupportedModelError at load, and that pair is skipped with the reason.
"""

from __future__ import annotations

import importlib

import pytest

from common.golden import GOLDEN_MODELS, discover_stages, failures, load_golden
from common.models import resolve_model

STAGES = discover_stages()
_llms: dict[tuple[str, str], object] = {}


def get_llm(stage_name: str, model: str):
    key = (stage_name, model)
    if key not in _llms:
        stage = importlib.import_module(stage_name)
        try:
            _llms[key] = stage.LLM(str(resolve_model(model)), device="cpu", dtype="float32")
        except stage.UnsupportedModelError as exc:
            _llms[key] = exc
    if isinstance(_llms[key], Exception):
        pytest.skip(f"{stage_name} does not support {model}: {_llms[key]}")
    return _llms[key]


@pytest.mark.parametrize("model", GOLDEN_MODELS)
@pytest.mark.parametrize("stage_name", STAGES)
def test_golden_greedy(stage_name: str, model: str):
    stage = importlib.import_module(stage_name)
    golden = load_golden(model)
    llm = get_llm(stage_name, model)
    cases = golden["cases"]
    # All prompts in one call: batching stages run them together, and must still match each reference.
    results = llm.generate([c["prompt"] for c in cases],
                           stage.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
    assert len(results) == len(cases)
    problems = failures(results, golden)
    assert not problems, f"{stage_name} on {model}:\n" + "\n".join(problems)
