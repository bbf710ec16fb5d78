"""Exercise mode is real: every task's tests fail on its stub and pass on the reference, and a
learner's session (start, write the function, check) works end to end. The exercise tests
themselves are tests/exercises/stageN.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import exercise_workspace as ws
from common import exercises
from common.exercise_tasks import BY_ID, TASKS
from common.stages import find_stages

ROOT = Path(__file__).resolve().parent.parent
STAGES = find_stages(ROOT)


# ---------------------------------------------------------------- the catalogue
def test_every_stage_has_at_least_three_tasks():
    assert len(TASKS) >= 27 and len(BY_ID) == len(TASKS), "ids are unique"
    for stage in STAGES:
        assert len(exercises.stage_tasks(stage.number)) >= 3, f"{stage.name}: under 3 exercises"


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_task_names_real_functions_tests_and_earlier_needs(task):
    stage = exercises.stage_of(task.stage)
    source = (stage.path / task.file).read_text(encoding="utf-8")
    for qualname, hint in task.symbols.items():
        ws.find_def(ws.parse(source), qualname)  # raises if the function is not there
        assert len(hint) > 60, f"{task.id}: the hint of {qualname} says too little"
    readme = (stage.path / "README.md").read_text(encoding="utf-8")
    headings = [line.lstrip("#").strip() for line in readme.splitlines() if line.startswith("#")]
    assert task.readme in headings, f"{task.id}: {stage.name}/README.md has no {task.readme!r}"
    assert exercises.task_tests(task.stage).get(task.id), f"{task.id} has no test"
    order = [t.id for t in exercises.stage_tasks(task.stage)]
    for need in task.needs:
        assert need in order[: order.index(task.id)], f"{task.id} needs {need}: list it first"


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_every_exercise_test_belongs_to_a_task_of_its_stage(stage):
    path = ROOT / "tests" / "exercises" / f"stage{stage.number}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    marked = exercises.task_tests(stage.number)
    tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name.startswith("test_")}
    assert tests == {name for names in marked.values() for name in names}, "unmarked tests"
    assert set(marked) <= {t.id for t in exercises.stage_tasks(stage.number)}


# ---------------------------------------------------------------- the source surgery
SAMPLE = '''import functools


class Cache:
    @functools.lru_cache  # decorators stay
    def match(self, ids: list[int],
              # a comment inside the signature stays
              limit: int = 3) -> int:
        """Docstrings stay."""
        # the body's comments go with it
        n = len(ids)
        return min(n, limit)

    def plain(self):
        # no docstring: the comment opening the body goes too
        return 1


def free(x):
    return x + 1
'''


def test_stubs_keep_signature_and_docstring_and_reset_restores_them():
    hints = {"Cache.match": "exercise 0.a: " + "hint " * 30, "Cache.plain": "exercise 0.b: b"}
    stubbed = ws.stub_source(SAMPLE, hints)
    for kept in ("@functools.lru_cache", "inside the signature stays", '"""Docstrings stay."""',
                 "return x + 1"):
        assert kept in stubbed
    for gone in ("min(n, limit)", "body's comments", "return 1", "opening the body"):
        assert gone not in stubbed
    assert all(len(line) <= ws.WIDTH for line in stubbed.splitlines())
    assert ws.is_stub(stubbed, "Cache.match") and ws.is_stub(stubbed, "Cache.plain")
    assert not ws.is_stub(stubbed, "free") and not ws.is_stub(SAMPLE, "Cache.match")
    namespace: dict = {}
    exec(compile(stubbed, "stubbed", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="exercise 0.a: hint hint"):
        namespace["Cache"]().match((1, 2))
    assert ws.replace_defs(stubbed, SAMPLE, ["Cache.match", "Cache.plain"]) == SAMPLE
    assert ws.digest(stubbed, ["Cache.match"]) != ws.digest(SAMPLE, ["Cache.match"])
    with pytest.raises(ws.SourceError, match="nope"):
        ws.stub_source(SAMPLE, {"Cache.nope": "exercise 0.c: c"})


# ---------------------------------------------------------------- the proof
def closure(task_id: str) -> set[str]:
    needs = set(BY_ID[task_id].needs)
    for need in list(needs):
        needs |= closure(need)
    return needs


def test_every_task_fails_on_its_stub_and_passes_on_the_reference(tmp_path):
    """One pytest run of tests/exercises: each test on the reference (it must pass), on a copy with
    only its own task stubbed, and on one with its whole stage stubbed (both must fail)."""
    report, copies = tmp_path / "report.json", tmp_path / "copies"
    copies.mkdir()
    env = dict(os.environ, SGLZ_EXERCISE_PROOF=str(copies), SGLZ_EXERCISE_REPORT=str(report),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("SGLZ_EXERCISE_ROOT", "SGLZ_EXERCISE_TASKS"):
        env.pop(name, None)
    files = [str(ROOT / "tests" / "exercises" / f"stage{s.number}.py") for s in STAGES]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line", *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    outcomes = json.loads(report.read_text())
    runs = {v: [o for o in outcomes if o["variant"] == v] for v in ("reference", "stub", "all")}
    assert len(runs["reference"]) == len(runs["stub"]) == len(runs["all"]) >= len(TASKS)
    assert {o["task"] for o in runs["reference"]} == set(BY_ID), "every task's tests ran"
    assert all(o["outcome"] == "passed" for o in runs["reference"])
    assert all(o["outcome"] == "xfailed" for o in runs["stub"] + runs["all"])
    assert {o["task"] for o in runs["stub"]} == set(BY_ID), "every task was tried on its stub"
    for o in runs["all"]:  # the whole stage stubbed: a test may stop at its own task or a need only
        blocked = set(exercises.BLOCKED.findall(o["message"] or ""))
        extra = blocked - {o["task"], *closure(o["task"])}
        assert not extra, f"{o['test']} stopped at the stub of {extra}: add it to the task's needs"


def test_selecting_tasks_leaves_the_rest_of_the_suite_alone():
    env = dict(os.environ, SGLZ_EXERCISE_TASKS="6.evict")
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "tests/exercises/stage6.py", "tests/test_setup_errors.py"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    ids = [line for line in out.splitlines() if "::" in line]
    assert any(i.startswith("tests/test_setup_errors.py::") for i in ids), out
    ours = [i for i in ids if i.startswith("tests/exercises/")]
    assert ours and all("test_evict" in i for i in ours), ours


# ---------------------------------------------------------------- a learner's session
def run_cli(capsys, *args) -> tuple[int, str]:
    code = exercises.main(list(args))
    return code, capsys.readouterr().out


def write_reference_bodies(path: Path, reference: Path, qualnames: list[str]) -> None:
    """What a learner does: replace each stub's `raise NotImplementedError(...)` by a body."""
    source, ref = path.read_text(), reference.read_text()
    lines, ref_lines = source.splitlines(keepends=True), ref.splitlines(keepends=True)
    edits = []
    for qualname in qualnames:
        stub = ws.find_def(ws.parse(source), qualname).body[-1]
        assert isinstance(stub, ast.Raise), f"{qualname} is not a stub"
        first, last = ws.body_lines(ref_lines, ws.find_def(ws.parse(ref), qualname))
        edits.append((stub.lineno, stub.end_lineno, ref_lines[first - 1 : last]))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1 : last] = new
    path.write_text("".join(lines))


def test_a_learner_starts_stage_6_writes_insert_and_checks(tmp_path, capsys):
    base = ["--dir", str(tmp_path)]
    code, out = run_cli(capsys, *base, "start", "6")
    assert code == 0 and "6.match_prefix" in out
    learner_file = tmp_path / "stage6_radix" / "stage6_radix" / "radix_cache.py"
    reference = ROOT / "stage6_radix" / "radix_cache.py"
    assert ws.is_stub(learner_file.read_text(), "RadixCache.insert")
    assert not ws.is_stub(reference.read_text(), "RadixCache.insert"), "the course is untouched"
    assert run_cli(capsys, *base, "start", "6")[0] == 2, "a second start would lose work: refused"

    code, out = run_cli(capsys, *base, "check", "6", "insert_split")  # the stub fails: its hint
    assert code == 1 and "FAIL  6.insert_split" in out
    assert "receives token ids and their KV slots" in out

    write_reference_bodies(learner_file, reference, ["RadixCache.insert", "RadixCache._split"])
    code, out = run_cli(capsys, *base, "check", "6", "6.insert_split")
    assert code == 0 and "PASS  6.insert_split" in out and "note:" not in out, out
    assert "[pass]" in run_cli(capsys, *base, "list", "6")[1]

    assert run_cli(capsys, *base, "reset", "6", "match_prefix")[0] == 0  # its reference body back
    code, out = run_cli(capsys, *base, "check", "6", "--json")
    report = json.loads(out)
    results = {r["id"]: r for r in report["tasks"]}
    assert code == 1 and report["passed"] == 2 and report["total"] == 5
    assert results["6.insert_split"]["passed"] and results["6.match_prefix"]["passed"]
    assert results["6.match_prefix"]["same_as_reference"], "reset: the course's own code"
    assert not results["6.evict"]["passed"]
    assert "NotImplementedError: exercise 6.evict" in results["6.evict"]["failed"][0]["message"]


def test_bad_requests_are_refused_by_name(tmp_path, capsys):
    base = ["--dir", str(tmp_path)]
    assert exercises.main([*base, "check", "6"]) == 2
    assert "python -m common.exercises start 6" in capsys.readouterr().err
    assert exercises.main([*base, "hint", "6", "no_such_task"]) == 2
    err = capsys.readouterr().err
    assert "no task 'no_such_task'" in err and "6.match_prefix" in err
    assert exercises.main([*base, "hint", "6", "1.decode_loop"]) == 2
    assert "belongs to stage 1" in capsys.readouterr().err


# ---------------------------------------------------------------- the READMEs
@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_stage_readme_lists_its_exercises(stage):
    readme = (stage.path / "README.md").read_text(encoding="utf-8")
    assert exercises.readme_section(stage.number) in readme, (
        f"{stage.name}/README.md: its Exercises section differs from the catalogue; "
        f"`python -m common.exercises readme {stage.number}` prints it")


def test_top_readme_and_course_guide_explain_exercise_mode():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Exercises" in readme and "(COURSE.md)" in readme
    assert f"{len(TASKS)} tasks" in readme, "the README counts the tasks"
    course = (ROOT / "COURSE.md").read_text(encoding="utf-8")
    for needle in ("check 6 --json", "python -m common.exercises start 6"):
        assert needle in course
    for task in TASKS:
        assert f"`{task.id}`" in course, f"COURSE.md's syllabus does not assign {task.id}"
