"""Stage 1's own lessons: Req/SamplingParams invariants, the KV cache, stopping, bad input, the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stage1_naive import LLM, Req, SamplingParams, UnsupportedModelError
from stage1_naive.engine import Engine
from stage1_naive.kv_cache import GrowingKVCache


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path))


@pytest.mark.parametrize("kwargs, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_is_greedy():
    assert SamplingParams().is_greedy and SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_req_lifecycle_matches_the_docstring():
    req = Req(0, [10, 11, 12, 13, 14], SamplingParams(max_new_tokens=3))
    assert (req.cached_len, req.device_len, req.extend_len, req.max_device_len) == (0, 5, 5, 8)
    assert req.next_input_ids() == [10, 11, 12, 13, 14]
    req.complete_one(99)  # after prefill
    assert (req.cached_len, req.device_len, req.extend_len) == (5, 6, 1)
    assert req.next_input_ids() == [99]
    req.complete_one(98)
    req.check_invariants()
    assert (req.cached_len, req.device_len, req.output_ids) == (6, 7, [99, 98])


def test_static_and_growing_caches_agree(tiny_llama_path):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    outs = []
    for kind in ("static", "growing"):
        engine = Engine(tiny_llama_path, kv_cache=kind)
        outs.append(engine.generate(Req(0, [5, 6, 7, 8, 9], params)).output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 20


def test_cached_decode_equals_recomputing_everything(tiny_llama_path):
    """The KV cache is an optimisation only: decode logits equal a full recompute of the sequence."""
    engine = Engine(tiny_llama_path)
    req = engine.generate(Req(0, [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=8, ignore_eos=True)))
    ids = torch.tensor(req.all_ids[:-1])
    full = engine.model(ids, torch.arange(len(ids)), GrowingKVCache(engine.config.num_layers), last_only=False)
    recomputed = full.argmax(-1)[len(req.input_ids) - 1:].tolist()  # [8] predictions of the generated tokens
    assert recomputed == req.output_ids


def test_stop_token_ids_and_ignore_eos(llm):
    (free,) = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop_at = free.token_ids[4]
    (stopped,) = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_at]))
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    a, b = llm.generate(["Hello there", "Hello there"], params)
    assert a.token_ids == b.token_ids
    (other,) = llm.generate(["Hello there"], SamplingParams(max_new_tokens=15, temperature=1.0, seed=7,
                                                             ignore_eos=True))
    assert other.token_ids != a.token_ids


def test_bad_inputs_give_clear_errors_and_the_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * llm.engine.max_context_len])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 10**9]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate(["hi"], SamplingParams(max_new_tokens=0))
    (ok,) = llm.generate(["hi"], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(ok.token_ids) == 3 and isinstance(ok.text, str)


def test_unknown_or_missing_models(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):  # the message lists the known names
        LLM("no-such-model")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing" / "folder"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_is_refused_by_name():
    from common.models import resolve_model

    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM"):
        LLM(str(resolve_model("tiny-qwen2")))


def test_command_line(tiny_llama_path):
    out = subprocess.run([sys.executable, "-m", "stage1_naive", "--model", str(tiny_llama_path), "--no-chat",
                          "--prompt", "Hello", "--max-new-tokens", "5", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "5 tokens in" in out.stdout and "tokens/s" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "stage1_naive", "--model", "nope", "--max-new-tokens", "5"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_bfloat16_casts_weights_but_keeps_rope_frequencies_float32(tiny_llama_path):
    engine = Engine(tiny_llama_path, dtype="bfloat16")
    attn = engine.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.bfloat16
    assert attn.rotary.inv_freq.dtype == torch.float32  # a bfloat16 copy would be off by up to 0.4%
    req = engine.generate(Req(0, [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert len(req.output_ids) == 4
