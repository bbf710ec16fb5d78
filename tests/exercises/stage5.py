"""Stage 5's exercises: CUDA-graph buckets, the static buffers' padding, the overlap loop's deferred
results. On a CPU the graphs run on common/graph_emulator.py, which records and replays ops as a
CUDA graph does.

Run them with `python -m common.exercises check 5` (your copy) or `check 5 --reference`.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

STAGE = "stage5_cudagraph"
BUFFERS = ("input_ids", "positions", "out_cache_loc", "req_rows", "seq_lens")


@pytest.mark.task("5.graph_buckets")
def test_bucket_sizes(stage):
    sizes = stage.graph.bucket_sizes
    assert sizes(1) == [1] and sizes(3) == [1, 2, 3] and sizes(8) == [1, 2, 4, 8]
    assert sizes(20) == [1, 2, 4, 8, 16, 20]
    assert sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="must be >= 1"):
        sizes(0)


@pytest.mark.task("5.graph_buckets")
def test_pick_bucket_takes_the_smallest_that_holds_the_batch(stage):
    buckets = [1, 2, 4, 8, 16, 20]
    picks = [stage.graph.pick_bucket(buckets, b) for b in (1, 2, 3, 5, 8, 9, 17, 20)]
    assert picks == [1, 2, 4, 8, 8, 16, 20, 20]
    with pytest.raises(ValueError, match="21"):
        stage.graph.pick_bucket(buckets, 21)


def bare_runner(stage, max_bs=8):
    """A GraphRunner's static buffers without a model to capture: all that load_inputs touches."""
    runner = object.__new__(stage.graph.GraphRunner)
    runner.buckets, runner.max_bs = stage.graph.bucket_sizes(max_bs), max_bs
    runner.dummy_slot = 999
    for name in BUFFERS:  # holding stale values of an earlier batch
        dtype = torch.int32 if name in ("req_rows", "seq_lens") else torch.long
        setattr(runner, name, torch.full((max_bs,), 77, dtype=dtype))
    return runner


def decode_batch(n):
    ids = torch.arange(n)
    return SimpleNamespace(batch_size=n, input_ids=ids + 100, positions=ids + 10,
                           out_cache_loc=ids + 500, req_rows=(ids + 3).int(),
                           seq_lens=(ids + 11).int())


@pytest.mark.task("5.graph_padding")
def test_load_inputs_copies_into_the_static_buffers_and_pads(stage):
    runner = bare_runner(stage)
    addresses = {n: getattr(runner, n).data_ptr() for n in BUFFERS}
    assert runner.load_inputs(decode_batch(3)) == 4
    assert runner.input_ids[:4].tolist() == [100, 101, 102, 0], "a padded row feeds token 0"
    assert runner.positions[:4].tolist() == [10, 11, 12, 0]
    assert runner.out_cache_loc[:4].tolist() == [500, 501, 502, 999], "K/V into the dummy slot"
    assert runner.req_rows[:4].tolist() == [3, 4, 5, 0]
    assert runner.seq_lens[:4].tolist() == [11, 12, 13, 1]
    assert {n: getattr(runner, n).data_ptr() for n in BUFFERS} == addresses, (
        "a graph reads fixed addresses: copy into the buffers, never replace them")


@pytest.mark.task("5.graph_padding")
def test_load_inputs_of_a_full_bucket_pads_nothing(stage):
    runner = bare_runner(stage)
    assert runner.load_inputs(decode_batch(8)) == 8
    assert runner.input_ids.tolist() == list(range(100, 108))
    assert runner.seq_lens.tolist() == list(range(11, 19))


@pytest.mark.task("5.graph_padding")
def test_emulated_graph_replays_give_the_eager_tokens(stage, monkeypatch, tiny_llama_path):
    from common import graph_emulator

    params = stage.SamplingParams(max_new_tokens=3, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10], [40, 41, 42, 43]]  # a decode batch of 3 replays bucket 4
    options = dict(attention_backend="torch", disable_overlap=True, max_total_tokens=256,
                   verbose=False)
    eager = stage.LLM(str(tiny_llama_path), disable_cuda_graph=True, **options)
    want = [r.token_ids for r in eager.generate(prompts, params)]
    monkeypatch.setattr(stage.graph._module, "cuda", graph_emulator)
    graphs = stage.LLM(str(tiny_llama_path), cuda_graph_max_bs=4, **options)
    assert [r.token_ids for r in graphs.generate(prompts, params)] == want
    assert graphs.engine.num_graph_replays >= 2, "the decode steps replayed a graph"


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_path):
    """What stage 4's loop (no overlap) generates, memoised: the truth for the overlap loop."""
    stage4 = importlib.import_module("stage4_scheduler")
    llm = stage4.LLM(str(tiny_llama_path), attention_backend="torch", max_total_tokens=256,
                     verbose=False)
    memo = {}

    def run(prompts, params: list[dict]):
        key = repr((prompts, params))
        if key not in memo:
            out = llm.generate(prompts, [stage4.SamplingParams(**p) for p in params])
            memo[key] = [(r.token_ids, r.finish_reason) for r in out]
        return memo[key]
    return run


@pytest.mark.task("5.overlap_results")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "synchronous"])
def test_the_loop_reads_each_step_tokens_and_stops(stage, tiny_llama_path, reference_tokens,
                                                   overlap):
    prompts = [[5, 6, 7], [9, 10, 11, 12], [40]]
    free = reference_tokens(prompts, [dict(max_new_tokens=8, ignore_eos=True)] * 3)
    stop = free[1][0][3]  # request 1 stops at its 4th token: the step after it is already launched
    params = [dict(max_new_tokens=n, stop_token_ids=[stop], ignore_eos=True) for n in (8, 8, 5)]
    want = reference_tokens(prompts, params)
    assert want[1][1] == "stop" and len(want[1][0]) <= 4
    with stage.LLM(str(tiny_llama_path), attention_backend="torch", max_total_tokens=256,
                   verbose=False, disable_overlap=not overlap) as llm:
        results = llm.generate(prompts, [stage.SamplingParams(**p) for p in params])
        assert [(r.token_ids, r.finish_reason) for r in results] == want
        llm.scheduler.check_integrity()
        assert not llm.scheduler.deferred, "a finished request's pages wait for its last step only"
        assert llm.scheduler.cache.num_used_pages == 0, "every page came back"
