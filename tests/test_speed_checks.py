"""The checks that measure (common/speed_checks.py): the course's code clears each threshold, a
copy slowed on purpose misses it and says by how much, and a GPU-only check is reported blocked on
a CPU, never failed. Each timing runs in a fresh process, as `check` runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import exercise_workspace as ws
from common import exercises, speed_checks

ROOT = Path(__file__).resolve().parent.parent


def timed(ids: list[str], root: Path | None, out: Path) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "common.speed_checks", *ids, "--json-out", str(out)]
    cmd += ["--root", str(root)] if root else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout + proc.stderr
    return {r["id"]: r for r in json.loads(out.read_text())}


def slowed_copy(root: Path, stage_name: str, file: str, qualname: str, line: str) -> None:
    """A copy of the stage with `line` planted first in the body of `qualname`: still correct,
    no longer fast."""
    pkg = root / stage_name
    shutil.copytree(ROOT / stage_name, pkg, ignore=ws.COPY_IGNORE)
    path = pkg / file
    lines = path.read_text().splitlines(keepends=True)
    node = ws.find_def(ws.parse("".join(lines)), qualname)
    first, _ = ws.body_lines(lines, node)
    indent = " " * (node.col_offset + 4)
    lines.insert(first - 1, f"{indent}{line}\n")
    path.write_text("".join(lines))


@pytest.mark.skipif(os.environ.get("SGLZ_TIMED") != "1",
                    reason="times engines: the suite runs no timed test; SGLZ_TIMED=1 on a quiet machine")
def test_the_course_clears_its_thresholds_and_slowed_copies_miss(tmp_path):
    reference = timed(["4.continuous_batching", "6.radix_cache"], None, tmp_path / "ref.json")
    # a scheduler that admits nobody while a batch runs: static batching again
    slowed_copy(tmp_path, "stage4_scheduler", "scheduler/prefill.py", "PrefillAdder.build",
                "if running and chunked is None: return None, []")
    # a lookup that costs more than the prefill it saves (10 ms a call, as a walk over every
    # cached token one at a time in Python would on a large tree)
    slowed_copy(tmp_path, "stage6_radix", "radix_cache.py", "RadixCache.match_prefix",
                "__import__('time').sleep(0.01)")
    slowed = timed(["4.continuous_batching", "6.radix_cache"], tmp_path, tmp_path / "slow.json")
    for check_id in ("4.continuous_batching", "6.radix_cache"):
        check, ref, slow = speed_checks.BY_ID[check_id], reference[check_id], slowed[check_id]
        assert ref["passed"] and ref["ratio"] >= check.threshold, ref
        assert f">= {check.threshold}x): passed by {ref['by']:.0%}" in ref["message"], ref
        assert slow["passed"] is False and slow["ratio"] < check.threshold, slow
        assert f"missed by {slow['by']:.0%}" in slow["message"], slow
        assert slow["ratio"] < ref["ratio"] / 1.3, ("the planted slowdown is what it sees",
                                                     ref, slow)


def test_verdict_says_by_how_much():
    check = speed_checks.BY_ID["4.continuous_batching"]
    assert speed_checks.verdict(check, 2.6)["message"] == (
        "continuous batching: 2.60x stage 2's static batch (needs >= 1.3x): passed by 100%")
    missed = speed_checks.verdict(check, 0.65)
    assert not missed["passed"] and missed["message"].endswith("missed by 50%")


def fake_tests(number, tasks, root, verbose):  # every test passes: the speed checks decide
    return [{"test": f"t::{t.id}", "task": t.id, "outcome": "passed"} for t in tasks]


def test_check_json_marks_gpu_checks_blocked_never_failed(monkeypatch, capsys):
    monkeypatch.setattr(exercises, "run_tests", fake_tests)
    monkeypatch.setattr(speed_checks, "has_gpu", lambda: False)
    timed_here = []
    monkeypatch.setattr(speed_checks, "run_in_subprocess",
                        lambda checks, *a: timed_here.extend(checks) or [])
    code = exercises.main(["check", "5", "--reference", "--json"])
    report = json.loads(capsys.readouterr().out)
    speed = {r["id"]: r for r in report["speed"]}
    assert code == 0 and report["passed"] == report["total"], "blocked is not failed"
    assert speed["5.cuda_graph_replay"]["blocked"] == "needs a GPU"
    assert speed["5.cuda_graph_replay"]["passed"] is None
    assert "check 5 --speed" in speed["5.compiled_step"]["skipped"], "opt-in: too slow by default"
    assert not timed_here
    exercises.main(["check", "5", "--reference", "--speed"])
    assert [c.id for c in timed_here] == ["5.compiled_step"]
    out = capsys.readouterr().out
    assert "CUDA-graph replay: blocked: needs a GPU" in out


def test_a_missed_speed_check_fails_check(monkeypatch, capsys):
    monkeypatch.setattr(exercises, "run_tests", fake_tests)
    check = speed_checks.BY_ID["4.continuous_batching"]
    monkeypatch.setattr(speed_checks, "run_in_subprocess",
                        lambda checks, *a: [speed_checks.verdict(check, 1.0)])
    assert exercises.main(["check", "4", "--reference"]) == 1
    out = capsys.readouterr().out
    assert "4/4 tasks pass" in out and "SLOW  continuous batching: 1.00x" in out
    assert exercises.main(["check", "4", "--reference", "prefill_adder"]) == 0, (
        "one task named: not timed")
    assert "timed by `check 4`" in capsys.readouterr().out
