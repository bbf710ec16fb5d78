"""How the bug-hunt tests find the code they test, and report on it (as tests/exercises/ does).

Each module names its stage (`STAGE = "stage4_scheduler"`); the `stage` fixture imports it from
SGLZ_EXERCISE_ROOT (a learner's workspace: `python -m common.exercises check N BUG`) or from this
checkout. SGLZ_BUG_REPORT=<file.json>: every test's outcome and first failure, for `check`, of this
folder's tests and of tests/exercises/ ones run in the same session.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKSPACE = os.environ.get("SGLZ_EXERCISE_ROOT")
REPORT = os.environ.get("SGLZ_BUG_REPORT")

if WORKSPACE:  # before any test module runs: `import stageN_x` must find the learner's copy
    sys.path.insert(0, str(Path(WORKSPACE).resolve()))


@pytest.fixture(scope="module")
def stage(request):
    name = request.module.STAGE
    expected = Path(WORKSPACE).resolve() / name if WORKSPACE else ROOT / name
    module = importlib.import_module(name)
    here = Path(module.__file__).resolve().parent
    assert here == expected, f"{name} was imported from {here}, not from {expected}"
    return module


_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    entry = _outcomes.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed"})
    if report.failed and entry["outcome"] == "passed":
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["outcome"] = "failed"
        entry["message"] = crash.message if crash else str(report.longrepr)[-2000:]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session):
    if REPORT:
        Path(REPORT).write_text(json.dumps(list(_outcomes.values()), indent=1))
