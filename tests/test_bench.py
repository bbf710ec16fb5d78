"""The benchmark support code: its module structure, the peers' runners and the profile, rehearsed on tiny models.
Timings here mean nothing (speed is shown by the benchmarks themselves); what is checked is that each part runs,
reports what it measured, and compares tokens honestly."""

from __future__ import annotations

import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parent.parent / "common"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "common":
                names |= {f"common.{alias.name}" for alias in node.names}
    return names


def test_sub_benchmarks_import_the_shared_helpers_not_the_dispatcher():
    """common/bench.py is the command line; it imports every sub-benchmark. A sub-benchmark that imported its helpers
    back from it would import in a circle: they live in common/bench_utils.py."""
    subs = sorted(COMMON.glob("bench_*.py"))
    assert subs and COMMON.joinpath("bench_utils.py") in subs
    circular = [p.name for p in subs if "common.bench" in imported_modules(p)]
    assert not circular, f"these import common.bench, which imports them: {circular}"
    assert "common.bench" not in imported_modules(COMMON / "bench_utils.py")


def test_peer_runner_times_generate_calls_and_leaves_prefill_out_of_batch1(tmp_path, monkeypatch):
    """common/peer_runner.py with a stand-in peer whose prompt costs 50 ms and each token 10 ms: the offline run is
    timed whole, the batch-1 decode time is the 1 + n token call minus the 1-token call, and the tokens come back."""
    import json
    import time

    from common import peer_runner

    class FakePeer:
        def __init__(self, req):
            self.calls = 0

        def generate(self, prompts, max_new_tokens):
            out = []
            for p, n in zip(prompts, max_new_tokens):
                time.sleep(0.05 + 0.01 * (n - 1))
                out.append([(p[-1] + i) % 7 for i in range(n)])
            return out

    monkeypatch.setitem(peer_runner.PEERS, "fake", FakePeer)
    req = {"repeats": 2, "warmup": {"prompts": [[1]], "max_new_tokens": [1]},
           "offline": {"prompts": [[1, 2], [3]], "max_new_tokens": [3, 2]}, "batch1": {"prompt": [4], "new_tokens": 10}}
    (tmp_path / "req.json").write_text(json.dumps(req))
    peer_runner.main(["fake", str(tmp_path / "req.json"), str(tmp_path / "res.json")])
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["offline"]["token_ids"] == [[2, 3, 4], [3, 4]] and len(res["offline"]["seconds"]) == 2
    assert min(res["offline"]["seconds"]) >= 0.05 + 0.02 + 0.05 + 0.01
    assert 0.09 <= min(res["batch1"]["decode_s"]) < 0.2  # 10 tokens x 10 ms, the 50 ms prompt left out
    assert res["batch1"]["token_ids"] == [(4 + i) % 7 for i in range(11)]
    assert res["batch1"]["copy_bandwidth"] == [None, None]  # no parent to measure it


def test_peer_asks_the_parent_for_the_bandwidth_around_a_timed_call(tmp_path, monkeypatch):
    """The pipe between common/bench_peers.py and a peer's process: the peer asks for the copy bandwidth right before
    and right after its timed call and waits; the parent measures it each time and answers; the peer keeps the
    mean. A real child process, the parent's measurement replaced by 10 and then 30 GB/s."""
    import json
    import sys
    import time

    from common import bench_peers, bench_utils

    answers = iter([10e9, 30e9])
    monkeypatch.setattr(bench_utils, "copy_bandwidth", lambda *a, **k: next(answers))
    child = tmp_path / "child.py"
    child.write_text(f"""import json, os, sys
sys.path.insert(0, {str(COMMON)!r})
import peer_runner
channel = (os.fdopen(int(sys.argv[2]), "w"), os.fdopen(int(sys.argv[3])))
seconds, out, bw = peer_runner.timed_with_bandwidth(lambda: 7, lambda: peer_runner.ask_bandwidth(channel))
open(sys.argv[1], "w").write(json.dumps([out, bw]))
""")
    proc, from_child, to_child = bench_peers.popen_with_channel([sys.executable, str(child), str(tmp_path / "out")])
    bench_peers.answer_bandwidth_requests(proc, from_child, to_child, time.monotonic() + 60)
    assert proc.returncode == 0
    assert json.loads((tmp_path / "out").read_text()) == [7, 20e9]
    assert next(answers, None) is None  # asked exactly twice


def test_peer_table_ratios_and_bandwidth_limit(capsys):
    """The comparison table: tokens/s from the best run, ratios against vLLM in the same dtype, the bandwidth limit
    of the best batch-1 run (the copy bandwidth measured around it / weight bytes per token), and token agreement
    with the course's last stage listed."""
    from common.bench_peers import print_peer_table

    def row(system, dtype, off_s, b1_s, ids):
        return {"system": system, "dtype": dtype, "weight_bytes": 10**9 if dtype == "float32" else 5 * 10**8,
                "offline": None if off_s is None else {"seconds": [off_s, off_s * 2], "token_ids": ids},
                "batch1": {"decode_s": [b1_s * 2, b1_s], "copy_bandwidth": [90e9, 40e9], "token_ids": [1, 2]}}

    rows = [row("stage5_cudagraph", "float32", 10.0, 4.0, [[1], [2]]), row("vllm", "float32", 20.0, 8.0, [[1], [3]]),
            row("llama.cpp", "float32", None, 2.0, None)]
    del rows[2]["batch1"]["copy_bandwidth"]  # a result without a parent to measure it: no limit
    print_peer_table(rows, output_tokens=1000, batch1_tokens=100)
    lines = capsys.readouterr().out.splitlines()
    ours = next(line for line in lines if "stage5_cudagraph" in line).split()
    assert ours[2:5] == ["100.0", "2.00x", "25.0"]  # 1000 tokens / 10 s; vs vLLM's 50; batch 1: 100 / 4 s
    assert ours[6:9] == ["40.0", "40.0", "0.62x"]  # the best run's 40 GB/s / 1 GB per token; 25 of 40
    vllm = next(line for line in lines if line.split()[0] == "vllm").split()
    assert vllm[-2:] == ["1/2,", "identical"]
    llama = next(line for line in lines if "llama.cpp" in line).split()
    assert llama[2] == "-" and llama[4] == "50.0" and llama[6:9] == ["-", "-", "-"]
    runs = next(line for line in lines if "batch-1 runs" in line and "stage5_cudagraph" in line)
    assert runs.endswith("stage5_cudagraph float32: 12.5 at 90.0 (0.14x), 25.0 at 40.0 (0.62x)")
    assert not any("batch-1 runs" in line and "llama.cpp" in line for line in lines)


def test_bandwidth_source_is_written_so_reads_reach_memory():
    """The copy bandwidth reads a source whose every byte was written first: an untouched CPU allocation
    maps to the kernel's shared zero page, so reading it would be served from cache and the 'bandwidth' (and the
    limit the peer table derives from it) would be inflated."""
    import torch

    from common.bench_utils import bandwidth_source, copy_bandwidth

    src = bandwidth_source("cpu", gib=1 / 1024)
    assert src.numel() == 1 << 20 and src.dtype == torch.uint8 and bool((src == 1).all())
    assert copy_bandwidth("cpu", gib=1 / 1024, repeats=2) > 0


def test_profile_splits_a_step_on_a_tiny_model(capsys):
    """`common.bench profile` on the tiny Llama: the timed split and the operator kinds are printed, and the kinds
    account for the forward pass (each share between 0 and 100%, matmuls present)."""
    import re

    from common.bench import main

    main(["profile", "--model", "tiny-llama", "--num-requests", "4", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    parts = ("prepare", "forward", "sample", "scheduler", "matmul", "attention", "KV copies", "Python and dispatch")
    for part in parts:
        assert part in out, out
    shares = [float(m) for m in re.findall(r"ms/step\s+(-?[\d.]+)%", out)]
    assert len(shares) == 11 and all(-1 <= s <= 100 for s in shares), out
    assert float(re.search(r"matmul\s+[\d.]+ ms/step\s+([\d.]+)%", out).group(1)) > 0
    # the sampler is found where the scheduler calls it, so its time is measured, not silently zero
    assert float(re.search(r"\n\s+sample\s+([\d.]+) ms/step", out).group(1)) > 0, out


def test_cpu_attention_bench_times_both_kernels_in_both_dtypes(capsys):
    """`common.bench cpu-attention` on a small case: a decode and a prefill time, and the decode's K/V bandwidth, for
    float32 and bfloat16, each printed as a positive number."""
    import re

    import pytest

    from common.bench import main

    if "cpu" not in __import__("stage5_cudagraph.attention", fromlist=["x"]).available_backends("cpu"):
        pytest.skip("the cpu attention backend did not build here (no C++ compiler?)")
    main(["cpu-attention", "--batch", "3", "--layers", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "3 requests" in out and "2-layer pool" in out, out
    for dtype in ("float32", "bfloat16"):
        line = re.search(rf"{dtype}\s+decode\s+([\d.]+) us/call \(\s*([\d.]+) GB/s of K/V\)\s+prefill\s+([\d.]+) us/call",
                         out)
        assert line and all(float(x) > 0 for x in line.groups()), out


def test_chunked_prefill_bench_times_each_size_and_compares_tokens(capsys):
    """`common.bench chunked-prefill` on a small case: both timings for each size, and float32's tokens equal at
    every size (a cut prompt's chunks give the tokens of the whole prompt)."""
    import re

    from common.bench import main

    main(["chunked-prefill", "--model", "tiny-llama", "--stage", "stage4_scheduler", "--dtypes", "float32",
          "--sizes", "8", "64", "--num-requests", "4", "--max-new-tokens", "4", "--repeats", "1",
          "--attention-backend", "torch"])
    out = capsys.readouterr().out
    for size in (8, 64):
        line = re.search(rf"float32\s+chunked_prefill_size\s+{size}\s+prefill only\s+([\d.]+) s\s+whole workload\s+"
                         r"([\d.]+) s\s+([\d.]+) output tok/s", out)
        assert line and all(float(x) > 0 for x in line.groups()), out
    assert "float32   the same tokens at every size: yes" in out, out


def test_course_runs_in_a_fresh_process_with_the_same_preload_as_vllm(monkeypatch):
    """`bench offline --peers`: the course's stage runs in a child process with the LD_PRELOAD vLLM gets (so that
    neither system is measured in an environment the other lacks), and returns what an in-process run returns."""
    from transformers import AutoTokenizer

    from common import bench_peers, bench_utils
    from common.bench_utils import mixed_workload
    from common.models import resolve_model

    monkeypatch.setenv("LD_PRELOAD", "/stale/lib.so")
    for name in ("course", "vllm", "llama.cpp"):
        env = bench_peers.system_env(name, 2, "/x/libtcmalloc.so:/x/libiomp5.so")
        assert env.get("LD_PRELOAD") == (None if name == "llama.cpp" else "/x/libtcmalloc.so:/x/libiomp5.so")
        assert bench_peers.system_env(name, 2, "").get("LD_PRELOAD") is None
    monkeypatch.delenv("LD_PRELOAD")

    path = str(resolve_model("tiny-llama"))
    work = mixed_workload(AutoTokenizer.from_pretrained(path), 3, 4, seed=1, max_prompt=32)
    batch1 = {"prompt": work.prompts[0], "new_tokens": 4}
    request = {"stage": "stage4_scheduler", "path": path, "dtype": "float32", "prompts": work.prompts,
               "max_new_tokens": work.max_new_tokens, "batch1": batch1, "repeats": 1,
               "options": {"max_running_requests": 3}, "threads": 1}
    monkeypatch.setattr(bench_utils, "copy_bandwidth", lambda *args, **kwargs: 123.0)
    child = bench_peers.run_peer("course", request)
    monkeypatch.undo()
    here = bench_peers.run_course("stage4_scheduler", path, "float32", work, batch1, 1, {"max_running_requests": 3})
    assert child["offline"]["token_ids"] == here["offline"]["token_ids"]
    assert [len(t) for t in child["offline"]["token_ids"]] == work.max_new_tokens
    assert child["batch1"]["token_ids"] == here["batch1"]["token_ids"]
    assert len(child["batch1"]["token_ids"]) == 5 and child["weight_bytes"] == here["weight_bytes"] > 0
    # its batch-1 run got the copy bandwidth from the parent, as a peer's do (the parent's probe here says 123)
    assert child["batch1"]["copy_bandwidth"] == [123.0]


def test_rounds_are_merged_per_system_every_run_kept(capsys):
    """`--rounds N`: each system runs N times in turn; its rows become one, with every run's timings (the table takes
    the best of them all and lists each)."""
    from common.bench_peers import merge_rounds, print_peer_table

    def row(system, offline_s, decode_s):
        return {"system": system, "dtype": "float32", "weight_bytes": 1e8,
                "offline": {"seconds": [offline_s], "token_ids": [[1, 2]]},
                "batch1": {"prefill_s": 0.1, "decode_s": [decode_s], "copy_bandwidth": [2e10], "token_ids": [3]}}

    rows = merge_rounds([row("stage9_moe defaults", 2.0, 1.0), row("vllm", 4.0, 2.0),
                         row("stage9_moe defaults", 1.0, 0.5), row("vllm", 5.0, 4.0)])
    assert [(r["system"], r["offline"]["seconds"], r["batch1"]["decode_s"]) for r in rows] == [
        ("stage9_moe defaults", [2.0, 1.0], [1.0, 0.5]), ("vllm", [4.0, 5.0], [2.0, 4.0])]
    print_peer_table(rows, output_tokens=100, batch1_tokens=10)
    out = capsys.readouterr().out
    assert "offline runs, tok/s: stage9_moe defaults float32: 50.0, 100.0" in out, out
    assert "offline runs, tok/s: vllm float32: 25.0, 20.0" in out, out
    assert "  4.00x" in out, out  # best against best: 100 / 25 tok/s
