"""Stage 6, optional part 6.6: beam search whose beams share their prefix pages.

Every hypothesis (tokens, and score within 1e-4 relative in float32) must be Hugging Face's
`generate(num_beams=k, do_sample=False)`, for k = 1, 2, 4, with the length penalty and early stopping
variants; the beams of a prompt must cost fewer pages and computed tokens than k separate requests; the
books must balance afterwards; bad arguments are refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.golden import load_hf_model
from common.models import resolve_model
from stage6_radix import LLM, SamplingParams

PROMPTS = ["The three most important inventions of the nineteenth century were",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
TINY_FAMILIES = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]


def hf_hypotheses(hf, prompt: list[int], k: int, max_new_tokens: int, eos: list[int],
                  length_penalty: float = 1.0, early_stopping=False) -> list[tuple[list[int], float]]:
    """transformers' k best hypotheses: (generated ids, score), best first. With k = 1 `generate` is
    greedy and returns no score: it is the sum of the chosen tokens' log-probabilities / len ** penalty."""
    out = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                      max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                      early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos[0],
                      temperature=None, top_p=None, top_k=None, output_scores=True,
                      return_dict_in_generate=True)
    if k == 1:
        ids = out.sequences[0, len(prompt):].tolist()
        logp = sum(float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, ids))
        return [(ids, logp / len(ids) ** length_penalty)]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # each hypothesis's generated length
    return [(out.sequences[i, len(prompt): len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def assert_same_hypotheses(ours, theirs, where: str) -> None:
    assert [h.token_ids for h in ours.sequences] == [ids for ids, _ in theirs], where
    for h, (_, score) in zip(ours.sequences, theirs):
        assert math.isclose(h.score, score, rel_tol=1e-4), f"{where}: score {h.score} != {score}"


def assert_idle_books(llm) -> None:
    sched = llm.scheduler
    sched.check_integrity()
    assert not sched.has_unfinished() and sched.cache.tree.protected_size == 0
    sched.flush_cache()
    sched.check_integrity()
    assert sched.cache.num_free_pages == sched.cache.pool.num_pages  # no page leaked


@pytest.mark.parametrize("model", TINY_FAMILIES)
def test_beam_search_matches_hf_on_every_family(model):
    path = resolve_model(model)
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=1, verbose=False)
    hf = load_hf_model(path)
    eos = sorted(llm.engine.eos_token_ids)
    # two prompts in one call (their beams run in the same batches) on the first family only
    prompts = [llm.encode(p) for p in PROMPTS[: 2 if model == TINY_FAMILIES[0] else 1]]
    for k in (1, 2, 4):
        results = llm.beam_search(prompts, beam_width=k, max_new_tokens=5)
        for prompt, result in zip(prompts, results):
            assert result.prompt_token_ids == prompt and len(result.sequences) == k
            assert_same_hypotheses(result, hf_hypotheses(hf, prompt, k, 5, eos), f"{model} k={k}")
    assert_idle_books(llm)


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model("tiny-qwen3")
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=1, verbose=False)
    return llm, load_hf_model(path)


# early_stopping: False (HF's heuristic), True (stop at k finished), "never" (with a positive
# penalty the best live beam is scored at max_new_tokens); penalties favouring long and short.
@pytest.mark.parametrize("length_penalty,early_stopping",
                         [(1.0, False), (1.0, True), (2.0, "never"), (0.0, True), (-1.0, "never")])
def test_length_penalty_and_early_stopping_match_hf(tiny, length_penalty, early_stopping):
    """A token the model likes is made a stop token (as if it were EOS), so hypotheses finish early
    and the length penalty and early stopping decide which survive."""
    llm, hf = tiny
    prompt = llm.encode(PROMPTS[0])
    greedy = llm.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids
    stop = greedy[2]
    eos = sorted(llm.engine.eos_token_ids | {stop})
    result = llm.beam_search([prompt], 4, 8, length_penalty=length_penalty,
                             early_stopping=early_stopping, stop_token_ids=[stop])[0]
    theirs = hf_hypotheses(hf, prompt, 4, 8, eos, length_penalty, early_stopping)
    assert_same_hypotheses(result, theirs, f"length_penalty={length_penalty} {early_stopping}")
    if length_penalty <= 0:  # short hypotheses are favoured: the stop token's survive
        assert any(h.finish_reason == "stop" and h.token_ids[-1] == stop for h in result.sequences)
    assert_idle_books(llm)


def test_beam_search_matches_hf_on_smollm2(smollm2_path):
    llm = LLM(str(smollm2_path), device="cpu", dtype="float32", page_size=1, verbose=False)
    hf = load_hf_model(smollm2_path)
    eos = sorted(llm.engine.eos_token_ids)
    chat = llm.apply_chat_template("What is the capital of France?")
    prompts = [llm.encode(PROMPTS[0]), chat]
    for prompt, result in zip(prompts, llm.beam_search(prompts, 4, 4)):  # (k = 1, 2: the tiny ones)
        assert_same_hypotheses(result, hf_hypotheses(hf, prompt, 4, 4, eos), "smollm2 k=4")
    assert_idle_books(llm)


@pytest.mark.parametrize("page_size", [1, 4])
def test_beams_share_prefix_pages(tiny_llama_path, page_size):
    """k beams against k separate requests for the same prompt and length (`common.bench_beam`, the
    README's figure): the beams compute the prompt once and each new token once (page_size 1:
    nothing recomputed, every computed token kept once in the tree); with bigger pages a fork
    recomputes only its partial last page."""
    import stage6_radix
    from common.bench_beam import measure

    k, n = 4, 8
    llm = LLM(str(tiny_llama_path), page_size=page_size, verbose=False)
    prompt = llm.encode(PROMPTS[0] * 6)
    L = len(prompt)
    m = measure(stage6_radix, str(tiny_llama_path), prompt, k, n, page_size)
    if page_size == 1:
        # the prompt once, then one token per beam in each round after the first (round 0 has one
        # beam), each computed once and kept once in the tree (so no stop token ended a round early)
        assert m["beam_tokens"] == m["beam_pages"] == L + k * (n - 1)
    else:
        assert L + k * (n - 1) <= m["beam_tokens"] <= L + k * (n - 1) * page_size
    assert m["sep_tokens"] == k * (L + n - 1)
    # (the stats are taken after a step: the last step in which they still hold pages afterwards
    # has L + n - 2 tokens each in the cache)
    assert m["sep_pages"] == k * -(-(L + n - 2) // page_size)
    assert m["beam_pages"] * 2 < m["sep_pages"] and m["beam_tokens"] * 2 < m["sep_tokens"]
    # the books balance after a search, and every page comes back once the tree is flushed
    llm.beam_search([prompt], k, n)
    assert_idle_books(llm)


def test_overlap_and_page_size_change_nothing(tiny_llama_path):
    prompts = [PROMPTS[0], PROMPTS[1]]
    want = LLM(str(tiny_llama_path), page_size=1, verbose=False).beam_search(prompts, 3, 6)
    got = LLM(str(tiny_llama_path), page_size=16, disable_overlap=False,
              verbose=False).beam_search(prompts, 3, 6)
    for w, g in zip(want, got):
        assert [h.token_ids for h in w.sequences] == [h.token_ids for h in g.sequences]
        assert all(math.isclose(a.score, b.score, rel_tol=1e-4)
                   for a, b in zip(w.sequences, g.sequences))


def test_bad_arguments_are_refused_by_name(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), page_size=1, verbose=False)
    cases = [(dict(beam_width=0), "beam_width"), (dict(beam_width=65), "beam_width"),
             (dict(beam_width=True), "beam_width"), (dict(beam_width=2.0), "beam_width"),
             (dict(max_new_tokens=0), "max_new_tokens"),
             (dict(length_penalty=float("nan")), "length_penalty"),
             (dict(early_stopping="sometimes"), "early_stopping"),
             (dict(stop_token_ids=[-1]), "stop_token_ids"),
             (dict(max_new_tokens=10**6), "context length")]
    for kwargs, name in cases:
        args = dict(beam_width=2, max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=name):
            llm.beam_search(PROMPTS[0], **args)
    with pytest.raises(ValueError, match="no prompts"):
        llm.beam_search([], 2, 4)
    llm.scheduler.check_integrity()
    # a prompt the pool cannot hold is refused by the scheduler after the first prompt's beam was
    # queued: that one is taken back, nothing is left running
    small = LLM(str(tiny_llama_path), page_size=1, max_total_tokens=64, verbose=False)
    with pytest.raises(ValueError, match="KV cache"):
        small.beam_search([[5] * 8, [6] * 80], 2, 4)
    assert not small.has_unfinished_requests()
    small.scheduler.check_integrity()
    # the engine still serves
    assert llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=3))[0].completion_tokens == 3
