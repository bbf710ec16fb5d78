"""How the exercise tests find the code they test, and report on it.

Each test module names its stage (`STAGE = "stage6_radix"`) and takes the `stage` fixture: that
package, imported from where this run says, and checked to come from there:

- SGLZ_EXERCISE_ROOT=<folder>: a learner's workspace (`python -m common.exercises check`). Its copy
  of the stage goes first on sys.path: `import stage6_radix` finds the learner's code.
- neither variable: the reference package of this checkout.
- SGLZ_EXERCISE_PROOF=<folder>: every test runs three times: on the reference (it must pass), on a
  copy of the stage with only its own task stubbed, and on one with all the stage's tasks stubbed
  as `start N` makes it (both must fail: `xfail(strict=True)`, so a test that passes on a stub
  fails the run). tests/test_exercises.py runs this.

SGLZ_EXERCISE_TASKS=6.insert_split,6.evict runs only those tasks' tests;
SGLZ_EXERCISE_REPORT=<file.json> writes every test's outcome and first failure there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKSPACE = os.environ.get("SGLZ_EXERCISE_ROOT")
PROOF = os.environ.get("SGLZ_EXERCISE_PROOF")
TASKS = {t for t in os.environ.get("SGLZ_EXERCISE_TASKS", "").split(",") if t}
REPORT = os.environ.get("SGLZ_EXERCISE_REPORT")

if WORKSPACE:  # before any test module runs: `import stageN_x` must find the learner's copy
    sys.path.insert(0, str(Path(WORKSPACE).resolve()))
if PROOF:
    sys.path.insert(0, str(Path(PROOF).resolve()))


class Stage:
    """A stage package: `stage.radix_cache.RadixCache`, `stage.LLM`; submodules imported on use."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        mod = self._module
        if hasattr(mod, "__path__"):
            full = f"{mod.__name__}.{name}"
            if full in sys.modules or importlib.util.find_spec(full) is not None:
                return Stage(importlib.import_module(full))
        return getattr(mod, name)

    def __repr__(self) -> str:
        return f"Stage({self._module.__name__} from {self._module.__file__})"


def task_of(item) -> str | None:
    mark = item.get_closest_marker("task")
    return mark.args[0] if mark else None


def pytest_configure(config):
    config.addinivalue_line("markers", "task(id): the exercise task a test checks: task('6.evict')")


def pytest_report_header(config):
    if WORKSPACE or PROOF:
        return f"exercises: testing {WORKSPACE or 'the reference and stubbed copies'}"
    return None


def pytest_generate_tests(metafunc):
    if PROOF and "stage" in metafunc.fixturenames:
        metafunc.parametrize("variant", ["reference", "stub", "all"])


def pytest_collection_modifyitems(config, items):
    selected, deselected = [], []
    for item in items:
        if item.path.parent != HERE:  # a test of the rest of the suite: not ours to select
            selected.append(item)
            continue
        task = task_of(item)
        if task is None:
            raise pytest.UsageError(f"{item.nodeid} has no @pytest.mark.task(...)")
        item.user_properties.append(("task", task))
        variant = getattr(item, "callspec", None) and item.callspec.params.get("variant")
        item.user_properties.append(("variant", variant or "reference"))
        if variant in ("stub", "all"):
            reason = f"the stub of {task} must fail this test"
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
        (selected if not TASKS or task in TASKS else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture
def variant() -> str:
    return "reference"


_built: dict[str, str] = {}


def stub_package(stage_name: str, task_id: str, every_task: bool) -> str:
    """A copy of the reference stage, importable as `<stage>__<task>`, with only that task stubbed
    (or, as `<stage>__all`, every task of the stage)."""
    from common import exercises

    task = exercises.task(task_id)
    name = f"{stage_name}__{'all' if every_task else task.name}"
    if name not in _built:
        tasks = exercises.stage_tasks(task.stage) if every_task else [task]
        exercises.make_copy(ROOT / stage_name, Path(PROOF) / name, tasks)
        _built[name] = name
    return name


@pytest.fixture
def stage(request, variant) -> Stage:
    name = request.module.STAGE
    if variant in ("stub", "all"):
        name = stub_package(name, task_of(request.node), every_task=variant == "all")
        expected = Path(PROOF).resolve() / name
    elif WORKSPACE:
        expected = Path(WORKSPACE).resolve() / name
    else:
        expected = ROOT / name
    module = importlib.import_module(name)
    here = Path(module.__file__).resolve().parent
    assert here == expected, f"{name} was imported from {here}, not from {expected}"
    return Stage(module)


_memo: dict[tuple, object] = {}


@pytest.fixture
def memo(stage):
    """memo(key, make): make() once per stage package (an engine on a tiny model, say)."""
    def get(key, make):
        k = (stage._module.__name__, key)
        if k not in _memo:
            while len(_memo) >= 4:  # a proof run alternates many packages: keep only the latest few
                _memo.pop(next(iter(_memo)))
            _memo[k] = make()
        return _memo[k]
    return get


# ---------------------------------------------------------------- the report `check` reads
_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    new = {"test": report.nodeid, "task": props.get("task"), "variant": props.get("variant"),
           "outcome": "passed"}
    entry = _outcomes.setdefault(report.nodeid, new)
    xfailed = report.skipped and hasattr(report, "wasxfail")
    if (report.failed or xfailed) and entry["outcome"] == "passed":
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["outcome"] = "xfailed" if xfailed else "failed"
        entry["message"] = crash.message if crash else str(report.longrepr)[-2000:]
        entry["location"] = failing_line(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def failing_line(report) -> str | None:
    """file:line of the test's line that failed (the assert, or its call into the code tested)."""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", [])
    test_file = report.location[0].rsplit("/", 1)[-1]
    lines = [e.reprfileloc for e in entries if getattr(e, "reprfileloc", None)
             and e.reprfileloc.path.endswith(test_file)]
    return f"{test_file}:{lines[-1].lineno}" if lines else None


def pytest_sessionfinish(session):
    if REPORT:
        Path(REPORT).write_text(json.dumps(list(_outcomes.values()), indent=1))
