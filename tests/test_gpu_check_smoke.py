"""common/gpu_check.sh, the course's one-command GPU check, rehearsed end to end on the CPU (`--smoke`): every step
runs its command with tiny shapes under its own timeout, writes its results under $OUT as it ends, and records its
exit status in steps.txt; a spent time budget skips the steps left, saying so, instead of overrunning."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["env", "models", "tests", "stage5", "attention", "moe", "radix", "tp", "tp_share"]


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
    assert "smoke 1" in (tmp_path / "env.txt").read_text()


def test_a_spent_budget_skips_the_remaining_steps(tmp_path):
    proc = run_check(tmp_path, budget=6, timeout=120)
    steps = outcomes(tmp_path)
    assert proc.returncode == 1
    assert any("skipped: the 6-second budget is spent" in line for line in steps.values())
    assert list(steps)[-1] == "tp_share"  # every step is accounted for
