"""common/gpu_check.sh, the course's one-command GPU check, rehearsed end to end on the CPU (`--smoke`): every step
runs its command with tiny shapes under its own timeout, writes its results under $OUT as it ends, and records its
exit status in steps.txt; a spent time budget skips the steps left, saying so, instead of overrunning."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from common.bench_gpu_rows import GIB, ModelShape, idle_between, memory_verdict, nano_vllm_workload, step_spans

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["env", "models", "tests", "stage5", "tp_share", "workload", "attention", "moe", "radix", "tp", "large"]


def run_check(out: Path, budget: int, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), BUDGET=str(budget))
    return subprocess.run(["bash", str(ROOT / "common" / "gpu_check.sh"), "--smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def outcomes(out: Path) -> dict[str, str]:
    lines = (out / "steps.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines if not line.startswith("total")}


@pytest.mark.slow  # every benchmark's CPU rehearsal, one after the other: minutes
def test_smoke_runs_every_step_and_writes_its_results(tmp_path):
    pytest.importorskip("triton")
    proc = run_check(tmp_path, budget=900, timeout=1000)
    steps = outcomes(tmp_path)
    assert list(steps) == STEPS, proc.stdout[-2000:]
    assert all(" exit 0 " in line for line in steps.values()), (tmp_path / "steps.txt").read_text()
    assert proc.returncode == 0
    for name in ["env.txt", "models.txt", "pytest_cuda.txt", "stage5_gpu.json", "stage5_gpu.md", "attention_gpu.md",
                 "stage7_gpu.json", "bench_radix.txt", "tp_share.json", "tp_share.md"]:
        assert (tmp_path / name).stat().st_size > 0, name
    share = json.loads((tmp_path / "tp_share.json").read_text())
    one, four = share["runs"]
    assert four["tp"] == 4 and four["tokens"] == one["tokens"]  # four ranks on one device: tp 1's tokens
    assert max(four["weights_gib_per_rank"]) < 0.5 * one["weights_gib_per_rank"][0]
    # float32: the sharded sums' rounding only (tests/test_stage7_tp_share_device.py)
    assert four["logits_max_abs_diff"] <= 1e-5 * four["logits_max_abs"]
    assert "smoke 1" in (tmp_path / "env.txt").read_text()
    check_stage_bench(tmp_path)


def check_stage_bench(out: Path) -> None:
    """The stage 5 / 9 bench's rows (common/bench_gpu_stage5.py): every column present, the tiny model's greedy
    tokens equal across graphs on/off x fusion on/off, overlap alternated, nano-vllm's workload all generated."""
    report = json.loads((out / "stage5_gpu.json").read_text())
    (model,) = report["models"]
    assert sorted(model["stages"]) == ["5", "9"]
    for stage in model["stages"].values():
        assert [r["batch"] for r in stage["decode"]] == [1, 3]
        for row in stage["decode"]:
            for run in ("graphs_on", "graphs_on_unfused", "graphs_off"):
                assert row[run]["step_ms"] > 0 and row[run]["kernels_per_step"] > 0
                assert 0 < row[run]["busy"] and row[run]["idle_ms"] >= 0
            assert row["graphs_on"]["graph_replays"] == row["graphs_on"]["steps"] > row["graphs_off"]["graph_replays"]
        assert stage["tokens"] == {"equal": True, "note": "", "compared": [
            "graphs on, fused", "graphs on, unfused", "graphs off, fused", "graphs off, unfused"]}
        assert stage["floor"]["ratio"] > 0
        assert [r["overlap"] for r in stage["overlap"]] == [True, False, True, False]
    md = (out / "stage5_gpu.md").read_text()
    assert report["date"] in md and "CPU (smoke run" in md and "`python -m common.bench_gpu_stage5 --smoke" in md
    work = json.loads((out / "workload_gpu.json").read_text())["models"][0]["stages"]
    _, lengths = nano_vllm_workload(8, 4, 16, vocab=512)  # the smoke workload on the tiny shape's vocabulary
    assert [w["workload"]["output_tokens"] for w in work.values()] == [sum(lengths)] * 2
    large = json.loads((out / "large_gpu.json").read_text())["models"][0]
    assert large["shape"]["dummy"] and "no load_format=dummy" in large["stages"]["5"]["skipped"]
    assert [r["batch"] for r in large["stages"]["9"]["decode"]] == [1] and large["stages"]["9"]["tokens"]["equal"]


def test_a_spent_budget_skips_the_remaining_steps(tmp_path):
    proc = run_check(tmp_path, budget=6, timeout=120)
    steps = outcomes(tmp_path)
    assert proc.returncode == 1
    assert any("skipped: the 6-second budget is spent" in line for line in steps.values())
    assert list(steps)[-1] == "large"  # every step is accounted for


def test_idle_time_between_steps_counts_only_the_gaps_no_kernel_fills():
    steps = [(30, 40), (0, 10), (15, 25)]  # any order
    kernels = [(0, 10), (11, 13), (15, 25), (30, 40)]  # a kernel (a copy, say) runs 2 of the first gap's 5
    assert idle_between(steps, kernels) == ((5 - 2) + 5) / 2
    assert idle_between(steps[:1], kernels) is None  # one step: no gap to measure
    assert idle_between([(0, 10), (8, 20)], kernels) == 0  # the next step began before this one ended


def test_step_boundaries_without_marks_come_from_the_kernels():
    # no STEP_MARK ranges: 3 steps of 2 kernels each -> equal runs
    kernels = [(0, 1), (1, 2), (5, 6), (6, 7), (10, 11), (11, 12)]
    assert step_spans([], None, kernels, 3) == ([(0, 2), (5, 7), (10, 12)], "equal runs")
    # 7 kernels over 3 steps cannot be equal runs: cut at the two widest gaps (2 -> 5 and 8 -> 10)
    kernels = [(0, 1), (1, 2), (5, 6), (6, 7), (7, 8), (10, 11), (11, 12)]
    assert step_spans([], None, kernels, 3) == ([(0, 2), (5, 8), (10, 12)], "widest gaps")


def test_a_shape_is_benched_only_where_its_weights_and_kv_fit():
    qwen32b = ModelShape.qwen3_32b()
    assert abs(qwen32b.num_params() - 32.8e9) / 32.8e9 < 0.01 and qwen32b.large  # Qwen3-32B, untied
    assert memory_verdict(qwen32b, 4096, free_bytes=None) is None  # a CPU: not checked
    assert memory_verdict(qwen32b, 4096, free_bytes=79 * GIB) is None  # an H100's ~79 GiB: ~70 GiB needed
    assert memory_verdict(qwen32b, 4096, free_bytes=46 * GIB).startswith("skipped: needs ~70 GiB")


def test_a_failing_stage_is_recorded_and_fails_the_bench(tmp_path, monkeypatch):
    from common import bench_gpu_stage5

    def failing(stage, *args):
        raise RuntimeError(f"planted failure in stage {stage}")

    monkeypatch.setattr(bench_gpu_stage5, "bench_stage", failing)
    with pytest.raises(SystemExit, match="a stage failed"):
        bench_gpu_stage5.main(["--smoke", "--out", str(tmp_path), "--stages", "9", "--models", "qwen3-0.6b-shape",
                               "--parts", "decode"])
    (model,) = json.loads((tmp_path / "stage5_gpu.json").read_text())["models"]
    assert model["stages"] == {"9": {"error": "RuntimeError: planted failure in stage 9"}}
    assert "- stage 9, tiny-shape: failed: RuntimeError: planted failure" in (tmp_path / "stage5_gpu.md").read_text()
