"""The golden-output harness: every stage, through the common API, against Hugging Face's greedy outputs.

Nothing here is stage-specific: a stage joins by existing. Stages 1 and 2 run Llama without RoPE scaling only
(their READMEs say so; the model zoo arrives in stage 3): for those documented pairs their UnsupportedModelError
is a skip, with the reason. Anywhere else an UnsupportedModelError is a failure: a later stage runs every checkpoint.
"""

from __future__ import annotations

import importlib

import pytest

from common.golden import GOLDEN_MODELS, discover_stages, failures, load_golden
from common.models import resolve_model

STAGES = discover_stages()
# The only pairs allowed to skip: what stages 1 and 2 document they cannot run (families and rope scaling of stage 3).
LLAMA_ONLY_STAGES = {"stage1_naive", "stage2_batch"}
BEYOND_LLAMA_ONLY = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"}


def load_llm(stage_name: str, model: str):
    stage = importlib.import_module(stage_name)
    try:
        return stage.LLM(str(resolve_model(model)), device="cpu", dtype="float32")
    except stage.UnsupportedModelError as exc:
        if stage_name in LLAMA_ONLY_STAGES and model in BEYOND_LLAMA_ONLY:
            pytest.skip(f"{stage_name} does not support {model}: {exc}")
        raise


@pytest.mark.parametrize("model", GOLDEN_MODELS)
@pytest.mark.parametrize("stage_name", STAGES)
def test_golden_greedy(stage_name: str, model: str):
    stage = importlib.import_module(stage_name)
    golden = load_golden(model)
    llm = load_llm(stage_name, model)
    cases = golden["cases"]
    # All prompts in one call: batching stages run them together, and must still match each reference.
    results = llm.generate([c["prompt"] for c in cases],
                           stage.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
    assert len(results) == len(cases)
    problems = failures(results, golden)
    assert not problems, f"{stage_name} on {model}:\n" + "\n".join(problems)


def test_llama_only_stages_still_refuse_what_they_document():
    """The skips above stay honest: stages 1 and 2 really refuse those checkpoints (and only with that error)."""
    for stage_name in sorted(LLAMA_ONLY_STAGES & set(STAGES)):
        stage = importlib.import_module(stage_name)
        for model in sorted(BEYOND_LLAMA_ONLY):
            with pytest.raises(stage.UnsupportedModelError):
                stage.LLM(str(resolve_model(model)), device="cpu", dtype="float32")
