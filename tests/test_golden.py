"""The golden-output harness: every stage, through the common API, against Hugging Face's greedy outputs.

Nothing here is stage-specific: a stage joins by existing. Each checkpoint has a first stage that runs it
(FIRST_STAGE: stages 1 and 2 run Llama without RoPE scaling only, the model zoo arrives in stage 3, mixture of
experts in stage 9); an earlier stage's UnsupportedModelError is a skip, with the reason. Anywhere else an
UnsupportedModelError is a failure: from its first stage on, every stage runs the checkpoint.
"""

from __future__ import annotations

import importlib
import re

import pytest

from common.golden import BF16_TIE_MARGIN, GOLDEN_MODELS, discover_stages, failures, load_golden
from common.models import resolve_model

STAGES = discover_stages()
# The first stage that runs each checkpoint; only the stages before it may skip it (what they document they lack).
FIRST_STAGE = {
    "smollm2-135m-instruct": 1, "tiny-llama": 1,
    "tiny-llama3": 3, "tiny-qwen2": 3, "tiny-qwen3": 3, "tiny-mistral": 3,  # rope scaling, model families
    "tiny-qwen3-moe": 9, "tiny-mixtral": 9,  # mixture of experts
}


def stage_number(stage_name: str) -> int:
    return int(re.match(r"stage(\d+)_", stage_name).group(1))


def may_skip(stage_name: str, model: str) -> bool:
    return stage_number(stage_name) < FIRST_STAGE[model]


def load_llm(stage_name: str, model: str):
    stage = importlib.import_module(stage_name)
    try:
        # From stage 5 on, the overlap loop (the default on CUDA, opt-in on a CPU), so that it is the path checked.
        options = {"disable_overlap": False} if stage_number(stage_name) >= 5 else {}
        return stage.LLM(str(resolve_model(model)), device="cpu", dtype="float32", **options)
    except stage.UnsupportedModelError as exc:
        if may_skip(stage_name, model):
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


# NGRAM drafts only from text that repeats: the tiny random checkpoints never repeat a bigram in their golden
# outputs, so there it would verify nothing (plain decoding, which test_golden_greedy checks already)
SPECULATIVE_CASES = [("NGRAM", "smollm2-135m-instruct")] + [("STANDALONE", m) for m in GOLDEN_MODELS]


@pytest.mark.parametrize("algorithm,model", SPECULATIVE_CASES)
def test_golden_greedy_with_speculative_decoding(algorithm: str, model: str, monkeypatch):
    """Stage 9's speculative decoding is exact under greedy: NGRAM drafts, and a STANDALONE draft model (tiny-llama,
    SmolLM2's vocabulary: itself for tiny-llama, a random guesser for the others), give the reference's tokens; every
    case verifies drafts."""
    import stage9_moe

    golden = load_golden(model)
    # all six prompts verify drafts together (a CPU batch over CPU_MAX_BATCH would decode without them)
    monkeypatch.setattr(stage9_moe.speculative.worker, "CPU_MAX_BATCH", len(golden["cases"]))
    options = {"speculative_draft_model_path": "tiny-llama"} if algorithm == "STANDALONE" else {}
    with stage9_moe.LLM(str(resolve_model(model)), dtype="float32", verbose=False, speculative_algorithm=algorithm,
                        **options) as llm:
        results = llm.generate([c["prompt"] for c in golden["cases"]],
                               stage9_moe.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
        worker = llm.scheduler.speculative
    problems = failures(results, golden)
    assert not problems, f"{algorithm} speculation on {model}:\n" + "\n".join(problems)
    assert worker.num_drafted > 0, "no draft was verified: the test would prove nothing"


def test_golden_greedy_with_speculative_decoding_at_tp_2():
    """The same at tensor parallelism 2 (every rank drafts, verifies and accepts the same tokens, checked by
    enable_tp_sync_check): tiny-llama with itself as the STANDALONE draft, four prompts a batch (a CPU batch of
    more than speculative.worker.CPU_MAX_BATCH decodes without drafts)."""
    import stage9_moe

    golden = load_golden("tiny-llama")
    path = str(resolve_model("tiny-llama"))
    params = stage9_moe.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0)
    prompts = [c["prompt"] for c in golden["cases"]]
    with stage9_moe.LLM(path, dtype="float32", verbose=False, tp_size=2, attention_backend="torch",
                        max_total_tokens=8192, enable_tp_sync_check=True, speculative_algorithm="STANDALONE",
                        speculative_draft_model_path=path) as llm:
        results = llm.generate(prompts[:4], params) + llm.generate(prompts[4:], params)
        assert llm.scheduler.speculative.num_accepted > 0, "no draft was accepted: the test would prove nothing"
    problems = failures(results, golden)
    assert not problems, "STANDALONE speculation at tp 2 on tiny-llama:\n" + "\n".join(problems)


BEAM_STAGES = [s for s in STAGES if stage_number(s) in (6, 9)]  # where beam search arrives, and the last stage


@pytest.mark.parametrize("model", GOLDEN_MODELS)
@pytest.mark.parametrize("stage_name", BEAM_STAGES)
def test_golden_beam_search_of_width_one(stage_name: str, model: str):
    """Beam search with one beam keeps the single best token each round: the greedy reference's tokens (its scoring
    path, one-token requests continuing from the radix tree, is checked against transformers' beam search for
    k = 2, 4 in tests/test_stage6_beam_search.py)."""
    if may_skip(stage_name, model):
        pytest.skip(f"{stage_name} does not run {model}")
    golden = load_golden(model)
    llm = load_llm(stage_name, model)
    results = llm.beam_search([c["prompt"] for c in golden["cases"]], beam_width=1,
                              max_new_tokens=golden["max_new_tokens"])
    problems = failures(results, golden)
    assert not problems, f"{stage_name} beam search (k = 1) on {model}:\n" + "\n".join(problems)


def test_golden_greedy_with_q4_1_weights():
    """Stage 9's --quantization q4_1 keeps the GGUF file's own blocks, and its kernels dequantize each weight to
    float32 as the reference's dequantized folder holds it: the golden tokens, from the .gguf file itself."""
    import stage9_moe
    from common.models import _find_gguf

    golden = load_golden("smollm2-135m-instruct")
    with stage9_moe.LLM(str(_find_gguf()), dtype="float32", verbose=False, quantization="q4_1") as llm:
        results = llm.generate([c["prompt"] for c in golden["cases"]],
                               stage9_moe.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
    problems = failures(results, golden)
    assert not problems, "q4_1 weights on smollm2-135m-instruct:\n" + "\n".join(problems)


def test_every_golden_checkpoint_has_a_first_stage():
    assert set(FIRST_STAGE) == set(GOLDEN_MODELS)


@pytest.mark.parametrize("model", [m for m in GOLDEN_MODELS if any(may_skip(s, m) for s in STAGES)])
def test_stages_before_a_checkpoints_first_stage_still_refuse_it(model: str):
    """The skips above stay honest: every stage allowed to skip a checkpoint really refuses it (and only with
    that error), at load, before generating anything."""
    for stage_name in [s for s in STAGES if may_skip(s, model)]:
        stage = importlib.import_module(stage_name)
        with pytest.raises(stage.UnsupportedModelError):
            stage.LLM(str(resolve_model(model)), device="cpu", dtype="float32")


BF16_STAGES = [s for s in STAGES if stage_number(s) >= 4]  # the bfloat16 CPU path, from stage 4


@pytest.mark.parametrize("stage_name", BF16_STAGES)
def test_golden_bfloat16_smollm2(stage_name: str):
    """bfloat16 weights and KV cache on the CPU against transformers in bfloat16. Two correct bfloat16 runs round
    differently, so a first divergence is accepted where the reference's own top-2 margin is below the bfloat16
    file's tie_margin (common/golden.py: BF16_TIE_MARGIN, and `common.golden bf16-spread`, which measures it);
    after it the texts differ and are not compared. On a margin above it the tokens must match."""
    stage = importlib.import_module(stage_name)
    golden = load_golden("smollm2-135m-instruct", "bfloat16")
    assert golden["dtype"] == "bfloat16" and golden["tie_margin"] == BF16_TIE_MARGIN
    llm = stage.LLM(str(resolve_model("smollm2-135m-instruct")), device="cpu", dtype="bfloat16", verbose=False)
    cases = golden["cases"]
    results = llm.generate([c["prompt"] for c in cases],
                           stage.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
    problems = failures(results, golden)
    assert not problems, f"{stage_name} in bfloat16:\n" + "\n".join(problems)
    identical = sum(list(r.token_ids) == c["output_ids"] for r, c in zip(results, cases))
    assert identical >= 1, "not one prompt identical to the reference: a real bfloat16 bug, not rounding"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_golden_smollm2_with_compiled_decode(backend: str):
    """Stage 5's CPU stand-in for CUDA graphs (torch.compile of the decode forward, bucket 1): SmolLM2's golden
    prompts one at a time, so that every decode step runs compiled code, give the float32 reference's tokens: with
    the torch attention backend (one opaque operator per layer) and with the cpu one (its operators in the graph)."""
    import stage5_cudagraph
    from stage5_cudagraph.attention import available_backends

    if backend not in available_backends("cpu"):
        pytest.skip(f"the {backend} attention backend is not available here")

    golden = load_golden("smollm2-135m-instruct")
    llm = stage5_cudagraph.LLM(str(resolve_model("smollm2-135m-instruct")), dtype="float32", verbose=False,
                               enable_torch_compile=True, torch_compile_max_bs=1, max_running_requests=1,
                               attention_backend=backend)
    params = stage5_cudagraph.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0)
    results = [llm.generate([case["prompt"]], params)[0] for case in golden["cases"]]
    problems = failures(results, golden)
    assert not problems, f"compiled decode on smollm2, {backend} attention:\n" + "\n".join(problems)
    decode_steps = sum(len(r.token_ids) - 1 for r in results)
    assert llm.engine.num_graph_replays == decode_steps and llm.engine.num_eager_forwards == len(results)


CPU_ATTENTION_STAGES = [s for s in STAGES if stage_number(s) >= 5]  # the "cpu" attention backend, from stage 5


@pytest.mark.parametrize("stage_name", CPU_ATTENTION_STAGES)
def test_golden_smollm2_with_each_cpu_attention_backend(stage_name: str):
    """From stage 5 on a CPU's default attention is the "cpu" backend (C++ kernels that read the paged cache in
    place, another summation order than SDPA's): named explicitly it gives the float32 reference's tokens, and so
    does the torch backend, no longer the default but still the reference; in stage 5 both stay within the bfloat16
    tie rule too."""
    stage = importlib.import_module(stage_name)
    backends = ["torch"]
    if "cpu" in importlib.import_module(f"{stage_name}.attention").available_backends("cpu"):
        backends.insert(0, "cpu")
        assert importlib.import_module(f"{stage_name}.attention").default_backend("cpu") == "cpu"
    for backend in backends:
        for dtype in ("float32", "bfloat16") if stage_number(stage_name) == 5 else ("float32",):
            golden = load_golden("smollm2-135m-instruct", *([] if dtype == "float32" else [dtype]))
            llm = stage.LLM(str(resolve_model("smollm2-135m-instruct")), device="cpu", dtype=dtype, verbose=False,
                            attention_backend=backend)
            assert llm.engine.attn_backend.name == backend
            results = llm.generate([c["prompt"] for c in golden["cases"]],
                                   stage.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
            problems = failures(results, golden)
            assert not problems, f"{stage_name}, {backend} attention backend, {dtype}:\n" + "\n".join(problems)
            if hasattr(llm, "close"):
                llm.close()
    if backends == ["torch"]:
        pytest.skip("the cpu attention backend did not build here (no C++ compiler?): torch checked alone")
