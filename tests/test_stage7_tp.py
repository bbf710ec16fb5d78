"""Stage 7's lesson: one model split over several ranks (torch.distributed over gloo on a CPU) gives the golden
tokens, each rank holding ~1/N of the weights and KV cache; several "nodes" on one machine work the same way; a
rank that fails ends the engine with its name instead of a hang."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tp_checks
from common.golden import failures, load_golden
from common.models import resolve_model
from stage7_tp import LLM, SamplingParams, tp_worker
from stage7_tp.distributed import TPDivergenceError, TPError, describe_divergence, free_port, valid_tp_sizes
from stage7_tp.server_args import ServerArgs
from stage7_tp.core import Req
from stage7_tp.tp_worker import Command, RankSpec, build_rank

TINY = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]


def golden_run(llm, model: str) -> list[str]:
    golden = load_golden(model)
    results = llm.generate([c["prompt"] for c in golden["cases"]],
                           SamplingParams(max_new_tokens=golden["max_new_tokens"]))
    return failures(results, golden)


def heads(model: str) -> tuple[int, int]:
    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    return cfg["num_attention_heads"], cfg["num_key_value_heads"]


@pytest.mark.parametrize("model", TINY)
def test_golden_at_tp_2_and_4(model):
    """With the radix cache, the overlap scheduler and chunked prefill on (a 64-token chunk cuts the long prompt)."""
    for tp in (2, 4):
        if tp not in valid_tp_sizes(*heads(model)):
            continue
        with LLM(str(resolve_model(model)), attention_backend="torch", tp_size=tp, chunked_prefill_size=64,
                 max_total_tokens=8192, disable_overlap=False, enable_tp_sync_check=True, verbose=False) as llm:
            assert llm.engine.tp.size == tp and llm.scheduler.overlap and llm.scheduler.cache.tree is not None
            problems = golden_run(llm, model)
        assert not problems, f"{model} at tp {tp}:\n" + "\n".join(problems)


def test_smollm2_at_tp_3(smollm2_path):
    """SmolLM2 has 9 query heads and 3 KV heads: tp 3 gives each rank 3 query heads and one KV head."""
    with LLM(str(smollm2_path), tp_size=3, max_total_tokens=8192, enable_tp_sync_check=True, verbose=False) as llm:
        assert llm.engine.num_kv_heads == 1 and llm.engine.model.model.layers[0].self_attn.num_heads == 3
        problems = golden_run(llm, "smollm2-135m-instruct")
    assert not problems, "\n".join(problems)


def test_each_rank_holds_and_reads_a_quarter(tiny_llama_path):
    path = str(tiny_llama_path)
    with LLM(path, attention_backend="torch", max_total_tokens=4096, verbose=False) as one:
        (full,) = one.rank_reports()
    with LLM(path, attention_backend="torch", tp_size=4, max_total_tokens=4096, verbose=False) as llm:
        reports = llm.rank_reports()
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    split = full["weight_bytes"] - full["replicated_bytes"]
    for r in reports:
        # The split part is a quarter (the vocabulary padded to a multiple of 4 adds nothing here: 49152 = 4 x 12288).
        assert r["weight_bytes"] - r["replicated_bytes"] == pytest.approx(split / 4, rel=0.01)
        assert r["replicated_bytes"] < 0.01 * r["weight_bytes"]  # norms, and the 2 KV heads shared by 4 ranks
        assert r["kv_heads"] == 1 and r["kv_bytes_per_token"] == full["kv_bytes_per_token"] / 2  # 2 KV heads
        assert r["kv_tokens"] == full["kv_tokens"] == 4096
        # Each rank read only its slices of the checkpoint (plus what it replicates), never a whole matrix.
        assert r["checkpoint_bytes_read"] < 0.3 * full["checkpoint_bytes_read"]


def test_dummy_weights_are_the_same_model_at_every_tp(tiny_llama_path):
    prompts = [[5, 6, 7, 8], [100, 200, 300] * 10]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        with LLM(str(tiny_llama_path), attention_backend="torch", tp_size=tp, load_format="dummy",
                 max_total_tokens=4096, enable_tp_sync_check=True, verbose=False) as llm:
            assert llm.engine.load_stats.bytes_read == 0
            outs[tp] = [r.token_ids for r in llm.generate(prompts, params)]
    with LLM(str(tiny_llama_path), attention_backend="torch", max_total_tokens=4096, verbose=False) as real:
        assert [r.token_ids for r in real.generate(prompts, params)] != outs[1]  # random weights, not the file's
    assert outs[1] == outs[2] and len(set(outs[1][0])) > 4  # and decisive: not one token repeated


def test_two_nodes_on_localhost_match_one(tiny_llama_path):
    path, addr = str(tiny_llama_path), f"127.0.0.1:{free_port()}"
    prompts = [[1, 2, 3], [9] * 40, [77, 78]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with LLM(path, attention_backend="torch", tp_size=4, max_total_tokens=4096, verbose=False) as one_node:
        want = [r.token_ids for r in one_node.generate(prompts, params)]
    node1 = subprocess.Popen([sys.executable, "-m", "stage7_tp", "--model", path, "--attention-backend", "torch",
                              "--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--max-total-tokens", "4096", "--enable-tp-sync-check"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        with LLM(path, attention_backend="torch", tp_size=4, nnodes=2, dist_init_addr=addr,
                 max_total_tokens=4096, enable_tp_sync_check=True, verbose=False) as llm:
            assert sorted(llm._ranks.procs) == [1]  # node 0 holds ranks 0 and 1; node 1 ranks 2 and 3
            assert [r.token_ids for r in llm.generate(prompts, params)] == want
        assert node1.wait(timeout=60) == 0, node1.stdout.read()
    finally:
        node1.kill()


def test_killing_a_rank_ends_the_engine_naming_it(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), attention_backend="torch", tp_size=4, max_total_tokens=4096, verbose=False)
    llm.add_request([1, 2, 3], SamplingParams(max_new_tokens=500, ignore_eos=True))
    for _ in range(3):
        llm.step()
    victim = llm._ranks.procs[2]
    os.kill(victim.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(TPError, match="rank 2 failed: its process was killed by signal 9"):
        while llm.has_unfinished_requests():
            llm.step()
    assert time.perf_counter() - start < 30
    llm.close()
    assert not any(p.is_alive() for p in llm._ranks.procs.values()), "no rank outlives the engine"


def test_an_exception_in_a_rank_reaches_the_caller_with_its_traceback(tiny_llama_path, monkeypatch):
    monkeypatch.setattr(tp_worker, "run_follower", functools.partial(tp_checks.follower_that_raises, "stage7_tp", 2))
    llm = LLM(str(tiny_llama_path), attention_backend="torch", tp_size=2, max_total_tokens=4096, verbose=False)
    llm.add_request([1, 2], SamplingParams(max_new_tokens=5))
    with pytest.raises(TPError, match=r"(?s)rank 1 failed: Traceback.*fault injected into rank 1 at step 2"):
        for _ in range(3):
            llm.step()
    llm.close()
    assert not any(p.is_alive() for p in llm._ranks.procs.values())


def test_close_stops_every_rank_and_bad_sizes_are_refused(tiny_llama_path):
    path = str(tiny_llama_path)
    llm = LLM(path, attention_backend="torch", tp_size=2, max_total_tokens=4096, verbose=False)
    procs = list(llm._ranks.procs.values())
    llm.close()
    assert llm.closed and not any(p.is_alive() for p in procs)
    with pytest.raises(ValueError, match="valid tp sizes: 1, 2, 4"):
        LLM(path, tp_size=3)  # 4 query heads, 2 KV heads: refused before any rank starts
    with pytest.raises(ValueError, match="multiple of nnodes"):
        LLM(path, tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1")
    assert valid_tp_sizes(9, 3, limit=9) == [1, 3, 9] and valid_tp_sizes(64, 8, limit=16) == [1, 2, 4, 8, 16]


def test_sampling_without_a_seed_agrees_across_ranks(tiny_llama_path):
    """A random draw must be the same on every rank, or the ranks' schedulers diverge: rank 0 gives the request
    a seed. Run twice with tp 2: both runs stay consistent (no hang, no error), and seeded requests reproduce."""
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]
    with LLM(str(tiny_llama_path), attention_backend="torch", tp_size=2, max_total_tokens=4096,
             enable_tp_sync_check=True, verbose=False) as llm:
        a = llm.generate([[1, 2, 3], [1, 2, 3]], params)
        b = llm.generate([[1, 2, 3], [1, 2, 3]], params)
    assert a[1].token_ids == b[1].token_ids and len(a[0].token_ids) == 10


def test_command_line(tiny_llama_path):
    out = subprocess.run([sys.executable, "-m", "stage7_tp", "--model", str(tiny_llama_path), "--no-chat",
                          "--prompt", "Hello", "--prompt", "Bonjour", "--max-new-tokens", "4", "--ignore-eos",
                          "--tp-size", "2", "--max-total-tokens", "4096", "--enable-tp-sync-check"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 requests, 8 tokens" in out.stdout and "tp rank 0 of 2" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "stage7_tp", "--model", str(tiny_llama_path), "--tp-size", "3"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "valid tp sizes: 1, 2, 4" in bad.stderr


def test_bench_tp_served_runs_end_to_end_on_a_cpu(tmp_path):
    """The GPU part of common/gpu_check.sh (`bench tp --served`) rehearsed on a CPU with a tiny model: every tp size
    loads, prefills and decodes, and the tables it writes hold numbers, not errors."""
    import json

    from common.bench import main

    main(["tp", "--served", "--model", "tiny-llama", "--tp", "1", "2", "--max-new-tokens", "4",
          "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "stage7_gpu.json").read_text())
    assert [r["tp"] for r in rows] == [1, 2] and not [r["error"] for r in rows if "error" in r]
    assert all(r["decode_ms_bs1"] > 0 and r["tok_s_bs32"] > 0 and r["kv_tokens"] > 0 for r in rows)
    assert rows[1]["weights_gib"] < 0.75 * rows[0]["weights_gib"]  # each of 2 ranks holds about half
    assert "| 2 |" in (tmp_path / "stage7_gpu.md").read_text()


def test_a_flush_and_an_abort_in_one_turn_apply_in_call_order_on_every_rank(tiny_llama_path):
    """Flush then abort keeps the aborted request's prompt pages (locked while it ran, so the flush spared them;
    the abort then gave them to the tree); abort then flush empties the tree. Each rank applies the turn's list in
    call order, so tp 2 (guarded) matches tp 1 in tokens and cached counts."""
    results = {}
    for tp in (1, 2):
        with LLM(str(tiny_llama_path), attention_backend="torch", tp_size=tp, max_total_tokens=4096,
                 enable_tp_sync_check=True, verbose=False) as llm:
            results[tp] = tp_checks.flush_and_abort_in_one_turn(llm, SamplingParams)
    assert [cached for _, cached in results[1]] == [48, 0]
    assert results[2] == results[1]


def test_control_operations_wait_for_the_next_step_and_leave_nothing_behind(tiny_llama_path):
    """At tp 1 too, adds, aborts and flushes are one list applied at the next step; every step empties it."""
    llm = LLM(str(tiny_llama_path), attention_backend="torch", max_total_tokens=4096, verbose=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request([1, 2], SamplingParams(temperature=-1.0))  # refused at once, by name
    rids = [llm.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True)) for _ in range(3)]
    assert llm.has_unfinished_requests() and llm.has_request(rids[0]) and not llm.scheduler.reqs
    for rid in rids:
        llm.step()
        llm.abort_request(rid)
        llm.flush_cache()
    llm.step()
    assert llm._pending == Command() and not llm.has_unfinished_requests()
    llm.scheduler.check_integrity()
    llm.close()


def test_ranks_after_0_hand_out_no_text_and_stop_where_rank_0_does(tiny_llama_path):
    """A follower's outputs go to nobody: it detokenizes only for stop strings, and stops where rank 0 stops."""
    args = ServerArgs(model_path=str(tiny_llama_path), attention_backend="torch", max_total_tokens=2048,
                      progress=False)
    spec = RankSpec(tiny_llama_path, None, args)
    runs = {}
    for rank in (0, 1):
        _, _, scheduler = build_rank(spec, rank, verbose=False)  # tp 1: the whole model, built as rank `rank`
        for rid, stop in ((0, None), (1, "e")):
            scheduler.add_request(Req(rid, [5, 6, 7], SamplingParams(max_new_tokens=30, stop=stop)))
        detokenized = set(scheduler.detok)
        outs = {0: [], 1: []}
        while scheduler.has_unfinished():
            for o in scheduler.step():
                outs[o.rid].append((o.new_token_ids, o.text_delta, o.finish_reason))
        runs[rank] = detokenized, outs
    (lead_detok, lead), (follow_detok, follow) = runs[0], runs[1]
    assert lead_detok == {0, 1} and follow_detok == {1}, "rank 1 keeps a detokenizer only for stop strings"
    assert [[(t, r) for t, _, r in lead[rid]] for rid in (0, 1)] == \
        [[(t, r) for t, _, r in follow[rid]] for rid in (0, 1)]
    assert lead[1][-1][2] == "stop" and "".join(d for _, d, _ in lead[0])
    assert not any(d for rid in (0, 1) for _, d, _ in follow[rid])


def test_the_divergence_guard_names_the_step_and_the_rank(tiny_llama_path, monkeypatch):
    """Rank 1's sampler is made to disagree once (its 3rd call: step 3); the guard stops the engine there."""
    monkeypatch.setattr(tp_worker, "run_follower",
                        functools.partial(tp_checks.follower_with_a_wrong_token, "stage7_tp", 3))
    with LLM(str(tiny_llama_path), attention_backend="torch", tp_size=2, max_total_tokens=4096,
             enable_tp_sync_check=True, verbose=False) as llm:
        with pytest.raises(TPDivergenceError, match=r"(?s)at scheduler step 3: rank\(s\) \[1\] differ.*sampled"):
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    text = describe_divergence(7, [(("prefill", [(0, 48, 4)]), [(0, [9])]), (("prefill", [(0, 48, 4)]), [(0, [9])]),
                                   (("prefill", [(0, 0, 52)]), [(0, [9])])])
    assert text.startswith("tensor-parallel ranks diverged at scheduler step 7: rank(s) [2] differ from rank 0")
    assert "batch (phase, [(rid, cached_len, extend_len)]): rank 0 ('prefill', [(0, 48, 4)]), rank 2" in text
    assert describe_divergence(7, [((None, []), [])] * 2) is None


def test_a_script_without_a_main_guard_is_told_what_to_add(tiny_llama_path, tmp_path):
    """Each rank re-runs the script that spawned it: a script that creates LLM(tp_size=2) at its top level gets
    the fix in words, at once, instead of a closed queue after the two-minute rendezvous timeout."""
    script = tmp_path / "no_main_guard.py"
    script.write_text(textwrap.dedent(f"""\
        from stage7_tp import LLM
        llm = LLM({str(tiny_llama_path)!r}, attention_backend="torch", tp_size=2, max_total_tokens=4096)
        print(llm.generate([[1, 2, 3]])[0].token_ids)
        """))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 1
    assert "LLM(tp_size=2) was called while a tensor-parallel rank was starting" in out.stderr
    assert 'if __name__ == "__main__":' in out.stderr and f"line 2 of {script}" in out.stderr
    assert "rank 1 failed: its process exited with status 1" in out.stderr and "is closed" not in out.stderr
    assert time.perf_counter() - start < 100, "rank 0 stopped waiting as soon as rank 1 died"
