"""Bug hunts are real: every planted bug fails its check and the reference passes it, every bug's
symptom probe shows what its report says (and the reference does not), and a learner's session
(plant, hint, fix, check) works end to end. The bugs: common/bug_catalogue.py."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import bug_hunts, exercises
from common.bug_catalogue import BUGS, BY_ID
from common.stages import find_stages

ROOT = Path(__file__).resolve().parent.parent
STAGES = {s.number: s.name for s in find_stages(ROOT)}
GUIDE = ROOT / "TROUBLESHOOTING.md"

# The bugs the course promises (issue: bug-hunt labs), each by the id that plants it.
PROMISED = {
    "an off-by-one in the KV append": "1.static_cache_disagrees",
    "a causal mask shifted by one": "1.wrong_from_the_first_token",
    "EOS ignored": "1.never_stops",
    "a page not returned on abort": "4.cancelled_requests_leak",
    "a radix node's lock not released": "6.cache_never_frees",
    "a rank that slices the wrong half": "7.tp2_gibberish",
    "a detokenizer that emits half a UTF-8 character": "4.stream_shows_replacement_chars",
    "a stop string checked only within one token": "8.stop_string_missed",
    "an admission rule that ignores running requests' growth": "4.preempts_under_load",
}


# ---------------------------------------------------------------- the catalogue
def test_at_least_two_bugs_per_stage_and_every_promised_one():
    assert len(BUGS) >= 18 and len(BY_ID) == len(BUGS), "ids are unique"
    for number in STAGES:
        assert len(bug_hunts.stage_bugs(number)) >= 2, f"stage {number}: under 2 bugs"
    for what, bug_id in PROMISED.items():
        assert bug_id in BY_ID, f"{what}: no bug {bug_id}"


def check_tests_of(bug) -> list[tuple[Path, str]]:
    return [(ROOT / n.split("::")[0], n.split("::")[1]) for n in bug.checks]


@pytest.mark.parametrize("bug", BUGS, ids=[b.id for b in BUGS])
def test_bug_plants_once_and_names_real_tests_hints_and_a_guide_section(bug):
    stage = STAGES[bug.stage]
    source = (ROOT / stage / bug.file).read_text(encoding="utf-8")
    planted = bug_hunts.planted_source(bug, source, f"{stage}/{bug.file}")  # pattern found once
    assert planted != source, "the planted copy differs from the reference"
    assert bug.id.startswith(f"{bug.stage}.") and re.fullmatch(r"\d\.[a-z0-9_]+", bug.id)
    for path, name in check_tests_of(bug):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{bug.id}: no test {name} in {path.relative_to(ROOT)}"
    assert len(bug.hints) >= 3 and all(len(h) > 60 for h in bug.hints)
    assert len(bug.symptom) > 60 and callable(getattr(bug_hunts_probes(), bug.probe))
    headings = [line.lstrip("#").strip() for line in GUIDE.read_text().splitlines()
                if line.startswith("## ")]
    assert bug.guide in headings, f"{bug.id}: TROUBLESHOOTING.md has no section {bug.guide!r}"
    assert f"`{bug.id}`" in GUIDE.read_text(), f"the guide does not point to {bug.id}"


def bug_hunts_probes():
    from common import bug_probes

    return bug_probes


def test_a_changed_reference_fails_loudly():
    bug = BY_ID["6.cache_never_frees"]
    with pytest.raises(bug_hunts.BugHuntError, match="pattern not found in stage6_radix/"):
        bug_hunts.planted_source(bug, "no such code", "stage6_radix/scheduler/cache_manager.py")


# ---------------------------------------------------------------- the proof
CONFLICTS = {5: {4}, 4: {5}}  # stage 5's tests take stage 4's engine as their truth


def rounds() -> list[list]:
    """Bugs grouped so that one pytest run checks several: one bug per stage per run, and no
    stage whose tests import another planted stage."""
    groups: list[list] = []
    for bug in BUGS:
        for group in groups:
            stages = {b.stage for b in group}
            if bug.stage not in stages and not CONFLICTS.get(bug.stage, set()) & stages:
                group.append(bug)
                break
        else:
            groups.append([bug])
    return groups


def test_the_reference_passes_every_check():
    results = bug_hunts.run_check(BUGS, None)
    failed = {r["id"]: r["failed"] for r in results if not r["passed"]}
    assert not failed, json.dumps(failed, indent=1)[:4000]


@pytest.mark.parametrize("group", range(len(rounds())))
def test_every_planted_bug_fails_its_check(group, tmp_path):
    bugs = rounds()[group]
    for bug in bugs:  # one workspace holding a planted copy of each stage of this round
        bug_hunts.planted_copy(STAGES[bug.stage], bug, tmp_path / STAGES[bug.stage])
    results = bug_hunts.run_check(bugs, tmp_path)
    passed = [r["id"] for r in results if r["passed"]]
    assert not passed, f"these planted bugs pass their check: {passed}"
    for r in results:
        assert all(f["message"] for f in r["failed"]), r


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    return tmp_path_factory.mktemp("planted")


@pytest.mark.parametrize("bug", BUGS, ids=[b.id for b in BUGS])
def test_the_symptom_is_what_the_report_says(bug, copies):
    import importlib

    stage = STAGES[bug.stage]
    name = f"{stage}__{bug.id.split('.')[1]}"
    bug_hunts.planted_copy(stage, bug, copies / name)
    seen, what = bug_hunts.probe(bug, bug_hunts.import_copy(copies, name))
    assert seen, f"{bug.id} planted, but its symptom does not show: {what}"
    seen, what = bug_hunts.probe(bug, importlib.import_module(stage))
    assert not seen, f"the reference {stage} shows {bug.id}'s symptom: {what}"


# ---------------------------------------------------------------- a learner's session
def run_cli(capsys, *args) -> tuple[int, str]:
    code = exercises.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_learner_plants_a_bug_follows_the_hints_fixes_it_and_checks(tmp_path, capsys):
    base = ["--dir", str(tmp_path)]
    bug = BY_ID["9.moe_answer_depends_on_batch"]
    code, out = run_cli(capsys, *base, "bug", "9", bug.id)
    assert code == 0 and bug.symptom[:40] in out
    assert bug.replace not in out, "planting tells the symptom, never the cause"
    learner_file = tmp_path / "stage9_moe" / "stage9_moe" / bug.file
    assert bug.replace in learner_file.read_text()
    assert bug.replace not in (ROOT / "stage9_moe" / bug.file).read_text(), "course untouched"
    assert "[planted]" in run_cli(capsys, *base, "bugs", "9")[1]

    first, second = run_cli(capsys, *base, "hint", "9", bug.id)[1], run_cli(
        capsys, *base, "hint", "9", bug.id)[1]
    assert "1. " in first and "2. " not in first and "2. " in second, "one step at a time"
    # a process of its own, as a learner runs it: this one may have imported the course's stage 9
    proc = subprocess.run([sys.executable, "-m", "common.exercises", *base, "symptom", "9",
                           bug.id], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SYMPTOM" in proc.stdout, proc.stdout + proc.stderr

    code, out = run_cli(capsys, *base, "check", "9", "--json")  # no name: the planted bugs
    report = json.loads(out)
    assert code == 1 and report["passed"] == 0 and report["bugs"][0]["id"] == bug.id
    assert report["bugs"][0]["hints_used"] == 2

    code, out = run_cli(capsys, *base, "solution", "9", bug.id)
    assert f"-{' ' * 12}topk_weights = {bug.replace}" in out, out
    fixed = learner_file.read_text().replace(bug.replace, bug.search)  # the learner's fix
    learner_file.write_text(fixed)
    code, out = run_cli(capsys, *base, "check", "9", bug.id.split(".")[1])
    assert code == 0 and f"FIXED  {bug.id}" in out
    assert "[fixed]" in run_cli(capsys, *base, "bugs", "9")[1]


def test_reset_takes_planted_bugs_out_and_bad_names_are_refused(tmp_path, capsys):
    base = ["--dir", str(tmp_path)]
    assert run_cli(capsys, *base, "bug", "6")[0] == 0  # one at random
    planted = json.loads((tmp_path / "stage6_radix" / "exercise.json").read_text())["bugs"]
    assert len(planted) == 1
    assert run_cli(capsys, *base, "reset", "6")[0] == 0
    copy, reference = tmp_path / "stage6_radix" / "stage6_radix", ROOT / "stage6_radix"
    for bug in bug_hunts.stage_bugs(6):
        assert (copy / bug.file).read_text() == (reference / bug.file).read_text()
    code, out = run_cli(capsys, *base, "hint", "6", "no_such_bug")
    assert code == 2 and "no task 'no_such_bug'" in out
    code, out = run_cli(capsys, *base, "check", "6", "evict", "cache_never_frees")
    assert code == 2 and "not both" in out
    code, out = run_cli(capsys, *base, "bug", "6", "1.never_stops")
    assert code == 2 and "belongs to stage 1" in out
    shutil.rmtree(tmp_path / "stage6_radix")
