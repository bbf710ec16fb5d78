"""Stage 7: tensor parallelism with several ranks on one device (`--gpu-id-step 0`, SGLang's placement option).

By default rank r of a node runs on GPU r (gpu_id_step 1), so tp 4 on a one-GPU machine is refused before any rank
starts, the error naming the opt-in. With gpu_id_step 0 every rank gets the same GPU: the model group is gloo (NCCL
refuses two ranks on one GPU), CUDA graphs are off (a gloo collective cannot be captured) and the KV pool size
must be given. On a CPU "one device" is the CPU itself: the rehearsal runs the opt-in path, four ranks each
holding a quarter of the model, and gives tp 1's tokens and, up to float32 rounding, its logits."""

from __future__ import annotations

import pytest
import torch

from common.gpu_tp_share import first_step_logits
from common.models import resolve_model
from stage7_tp import LLM, SamplingParams
from stage7_tp.server_args import ServerArgs
from stage7_tp.tp_worker import RankSpec


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one CUDA GPU, as far as the placement code can tell (nothing is allocated on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def spec(tmp_path, **kw) -> RankSpec:
    return RankSpec(tmp_path, None, ServerArgs(model_path=str(tmp_path), **kw))


def test_tp_4_on_one_gpu_is_refused_naming_the_opt_in(one_gpu, tmp_path):
    s = spec(tmp_path, device="cuda", tp_size=4, max_total_tokens=4096)
    assert s.device_for(0) == "cuda:0" and not s.shares_device
    with pytest.raises(ValueError, match=r"rank 1 on cuda:1, but this machine has 1 CUDA GPU.*--gpu-id-step 0"):
        s.device_for(1)


def test_gpu_id_step_0_puts_every_rank_on_one_gpu(one_gpu, tmp_path):
    s = spec(tmp_path, device="cuda", tp_size=4, gpu_id_step=0, max_total_tokens=4096)
    assert s.shares_device and [s.device_for(r) for r in range(4)] == ["cuda:0"] * 4
    with pytest.raises(ValueError, match="max_total_tokens"):  # four ranks, one free-memory figure
        ServerArgs(device="cuda", tp_size=4, gpu_id_step=0)
    with pytest.raises(ValueError, match="gpu_id_step must be >= 0"):
        ServerArgs(gpu_id_step=-1)
    assert not spec(tmp_path, tp_size=4, gpu_id_step=0).shares_device  # a CPU: one device anyway


def test_tp_4_with_gpu_id_step_0_gives_tp_1s_tokens_and_logits_on_a_cpu():
    path = str(resolve_model("tiny-llama"))
    prompts = [[5, 6, 7, 8], [100, 200, 300], [42] * 9]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(path, attention_backend="torch", max_total_tokens=2048, verbose=False) as one, \
            first_step_logits(one) as one_logits:
        want = [r.token_ids for r in one.generate(prompts, params)]
    with LLM(path, attention_backend="torch", tp_size=4, gpu_id_step=0, max_total_tokens=2048,
             enable_tp_sync_check=True, verbose=False) as four:
        assert four.engine.tp.size == 4
        layer = four.engine.model.model.layers[0]
        full = one.engine.model.model.layers[0]
        assert layer.mlp.gate_up_proj.weight.shape[0] * 4 == full.mlp.gate_up_proj.weight.shape[0]
        with first_step_logits(four) as four_logits:
            assert [r.token_ids for r in four.generate(prompts, params)] == want
    (a,), (b,) = one_logits, four_logits  # the first step: one prefill of the three prompts, [3, vocab] each
    assert a.shape == b.shape == (3, four.engine.config.vocab_size) and a.abs().max() > 1
    # the row-parallel matmuls add four partial sums where tp 1 adds one: float32 rounding, nothing more (~1e-6 of
    # the logits' scale; a missing or doubled all-reduce is off by the scale itself)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
