"""Statistical and exact tests of stage 4's batched sampler."""

from __future__ import annotations

import torch

from stage4_scheduler.core import Req, SamplingParams as SP
from stage4_scheduler.sampler import apply_penalties, sample


def reqs_for(params, output_ids=None, input_ids=None):
    return [Req(i, list(input_ids or [0]), p, output_ids=list(output_ids or [])) for i, p in enumerate(params)]


def support(logits, params, n=400, seed=0):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    seen = [set() for _ in params]
    for _ in range(n):
        for b, t in enumerate(sample(logits, reqs_for(params), gens)):
            seen[b].add(t)
    return seen


def test_top_k_top_p_min_p_keep_exactly_the_right_support():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    logits = probs.log()[None, :].repeat(3, 1)
    params = [SP(temperature=1.0, top_k=3), SP(temperature=1.0, top_p=0.78), SP(temperature=1.0, min_p=0.3)]
    seen = support(logits, params)
    assert seen[0] == {0, 1, 2}  # the 3 most likely
    assert seen[1] == {0, 1, 2}  # 0.40 + 0.25 = 0.65 < 0.78, + 0.15 = 0.80 >= 0.78: three tokens
    assert seen[2] == {0, 1, 2}  # p >= 0.3 * 0.40 = 0.12


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, reqs_for([SP(temperature=0.7)]), [gen])[0]] += 1
    assert torch.allclose(counts / 4000, torch.softmax(logits[0] / 0.7, -1), atol=0.03)


def test_seeded_rows_are_reproducible_in_any_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 1000)
    p = SP(temperature=1.0, top_p=0.9, seed=5)
    for _ in range(5):
        in_batch = sample(logits, reqs_for([p] * 3), [None, torch.Generator().manual_seed(5), None])[1]
        alone = sample(logits[1:2], reqs_for([p]), [torch.Generator().manual_seed(5)])[0]
        assert in_batch == alone


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    (req,) = reqs_for([params], output_ids=[3, 3, 1], input_ids=[2])
    out = apply_penalties(logits, [req])[0]
    # token 0: untouched; 1: seen, negative -> *2, once in output -> -0.5 -0.25; 2: in the prompt only -> /2;
    # 3: seen, positive -> /2, twice in output -> -1.0 -0.25
    expected = torch.tensor([2.0, -2.0 - 0.5 - 0.25, 0.25, 1.5 - 1.0 - 0.25])
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0]]))  # the input is not modified


def test_greedy_rows_with_penalties_take_the_penalised_argmax():
    logits = torch.tensor([[1.0, 0.9]])
    (req,) = reqs_for([SP(presence_penalty=0.5)], output_ids=[0])
    assert sample(logits, [req], [None]) == [1]


def test_sampling_params_refuse_what_would_break_a_step_and_tiny_temperatures_are_greedy():
    """A seed torch's Generator cannot take and NaN/inf are refused by name when the request is made,
    not in the middle of a step; below 1e-6 a temperature is greedy (logits / 1e-300 overflow)."""
    import pytest

    SamplingParams = SP

    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    for bad in ({"seed": 2**64}, {"seed": -1}, {"seed": 1.5}):
        with pytest.raises(ValueError, match="seed must be an int in"):
            SamplingParams(**bad)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                SamplingParams(**{name: value})
    assert SamplingParams(temperature=1e-300).is_greedy and SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
