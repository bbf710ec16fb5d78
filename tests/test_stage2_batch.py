"""Stage 2's lessons: a batch gives each request exactly the tokens it gets alone; padded == packed; batched
sampling is per request and seeded; a bad request fails alone."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from stage2_batch import LLM, SamplingParams
from stage2_batch.attention import available_backends
from stage2_batch.core import SamplingParams as SP
from stage2_batch.sampler import sample


def mixed_requests(n: int, seed: int = 0):
    """n prompts of mixed lengths (1..120 tokens) with mixed output lengths (1..24 tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.choice([1, 3, 17, 40, 120]))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 24), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), attention_backend="torch")


def test_32_requests_batched_equal_alone(llm):
    prompts, params = mixed_requests(32)
    batched = llm.generate(prompts, params)
    for prompt, p, result in zip(prompts, params, batched):
        (alone,) = llm.generate([prompt], p)
        assert result.token_ids == alone.token_ids
        assert len(result.token_ids) == p.max_new_tokens and result.finish_reason == "length"


@pytest.mark.parametrize("backend", [b for b in ("triton", "flash_attn") if b in available_backends("cpu")])
def test_other_backends_give_the_same_tokens(tiny_llama_path, llm, backend):
    prompts, params = mixed_requests(8, seed=1)  # the Triton interpreter is slow on a CPU: a smaller batch
    other = LLM(str(tiny_llama_path), attention_backend=backend)
    want = [r.token_ids for r in llm.generate(prompts, params)]
    assert [r.token_ids for r in other.generate(prompts, params)] == want


def test_padded_and_packed_give_the_same_tokens(llm):
    prompts, params = mixed_requests(12, seed=2)
    packed = llm.generate(prompts, params)
    padded = llm.generate(prompts, params, pad_to_longest=True)
    assert [r.token_ids for r in packed] == [r.token_ids for r in padded]


def test_batches_larger_than_max_batch_size_run_in_turns(tiny_llama_path, llm):
    prompts, params = mixed_requests(10, seed=3)
    small = LLM(str(tiny_llama_path), attention_backend="torch", max_batch_size=3)
    assert [r.token_ids for r in small.generate(prompts, params)] == [r.token_ids for r in llm.generate(prompts, params)]


def test_a_bad_request_fails_alone(llm):
    good = SamplingParams(max_new_tokens=5, ignore_eos=True)
    too_long = [7] * llm.engine.max_context_len
    results = llm.generate(["Hello", "", too_long, [1, 10**9], "World", 42], good)
    assert [r.finish_reason for r in results] == ["length", "error", "error", "error", "length", "error"]
    assert "empty" in results[1].error and "context" in results[2].error and "token ids" in results[3].error
    assert "string or a list" in results[5].error
    assert len(results[0].token_ids) == 5 and len(results[4].token_ids) == 5
    (alone,) = llm.generate(["World"], good)
    assert alone.token_ids == results[4].token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    (alone,) = llm.generate(["A seeded request"], seeded)
    others = [SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True), SamplingParams(max_new_tokens=3)]
    batch = llm.generate(["noise one", "A seeded request", "noise two"], [others[0], seeded, others[1]])
    assert batch[1].token_ids == alone.token_ids


def test_sampler_rows_follow_their_own_params():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SP(), SP(temperature=1.0, top_k=1), SP(temperature=1.0, top_k=3), SP(temperature=1.0, top_p=1e-6)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    top3 = set(logits[2].topk(3).indices.tolist())
    for _ in range(50):
        ids = sample(logits, params, gens)
        assert ids[0] == int(logits[0].argmax()) and ids[1] == int(logits[1].argmax())
        assert ids[2] in top3  # top-k keeps exactly the k best
        assert ids[3] == int(logits[3].argmax())  # a tiny top_p keeps only the best token


def test_sampler_matches_the_distribution():
    """Sampling at temperature T draws token i with probability softmax(logits / T)_i."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 4000
    for _ in range(n):
        counts[sample(logits, [SP(temperature=0.5)], [gen])[0]] += 1
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_command_line_batches_prompts(tiny_llama_path):
    out = subprocess.run([sys.executable, "-m", "stage2_batch", "--model", str(tiny_llama_path), "--no-chat",
                          "--prompt", "Hello", "--prompt", "Bonjour", "--max-new-tokens", "4", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 requests, 8 tokens" in out.stdout and "attention backend torch" in out.stdout
