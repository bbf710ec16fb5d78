"""Bug hunts: a known bug planted in your copy of a stage; find it from its symptom, fix it.

    python -m common.exercises bugs [N]        every bug: id, the symptom reported, your status
    python -m common.exercises bug N [ID]      plant it in your copy of stage N (ID left out: one
                                               at random that you have not fixed yet)
    python -m common.exercises symptom N ID    see the symptom happen, on your copy
    python -m common.exercises hint N ID       the next step of the diagnosis (again: the next)
    python -m common.exercises check N ID      the tests that prove the fix (--json: grading)
    python -m common.exercises solution N ID   the planted change, as a diff
    python -m common.exercises reset N         take the bugs out again

A bug is one exact search/replace on one file of the stage, applied to your copy only
(exercises/<stage>/, git-ignored): the course's stage folders never hold one. Its check is a list
of tests (tests/exercises/stageN.py, tests/bugs/bugs_stageN.py) that fail with the bug and pass
on the reference; its probe shows the symptom as the user saw it. tests/test_bug_hunts.py proves
all three for every bug. The catalogue is common/bug_catalogue.py, the probes common/bug_probes.py.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from common.bug_catalogue import BUGS, BY_ID, Bug

ROOT = Path(__file__).resolve().parent.parent
STATE_KEY = "bugs"  # in the workspace's exercise.json: {id: {"hints": n, "passed": bool}}


class BugHuntError(Exception):
    """A user mistake: printed as `error: ...`, exit status 2."""


def is_bug_id(name: str, stage: int | None = None) -> bool:
    full = name if "." in name else f"{stage}.{name}"
    return full in BY_ID


def bug(bug_id: str, stage: int | None = None) -> Bug:
    full = bug_id if "." in bug_id else f"{stage}.{bug_id}"
    if full not in BY_ID:
        known = ", ".join(b.id for b in BUGS if stage is None or b.stage == stage)
        raise BugHuntError(f"no bug {bug_id!r}; the bugs are: {known}")
    found = BY_ID[full]
    if stage is not None and found.stage != stage:
        raise BugHuntError(f"bug {found.id} belongs to stage {found.stage}, not {stage}")
    return found


def stage_bugs(number: int) -> list[Bug]:
    return [b for b in BUGS if b.stage == number]


# ---------------------------------------------------------------- the planted change
def planted_source(b: Bug, source: str, where: str) -> str:
    """`source` with the bug's search text replaced; the search text must occur exactly once."""
    count = source.count(b.search)
    if count != 1:
        raise BugHuntError(f"bug {b.id}: pattern not found in {where}" if count == 0 else
                           f"bug {b.id}: pattern found {count} times in {where}, must be once")
    return source.replace(b.search, b.replace)


def plant(b: Bug, pkg: Path) -> None:
    """Plant the bug in the stage package at `pkg` (a copy, never the course's)."""
    path = pkg / b.file
    source = path.read_text(encoding="utf-8")
    path.write_text(planted_source(b, source, f"{pkg.name}/{b.file}"), encoding="utf-8")


def unplant(b: Bug, pkg: Path) -> bool:
    """Undo the planted change where it is still there as planted; False where it is not."""
    path = pkg / b.file
    source = path.read_text(encoding="utf-8")
    if source.count(b.search) or source.count(b.replace) != 1:  # fixed already, or edited
        return False
    path.write_text(source.replace(b.replace, b.search), encoding="utf-8")
    return True


def diff(b: Bug, stage_name: str) -> str:
    """The planted change as a unified diff: what `solution` prints (the fix is its reverse)."""
    reference = (ROOT / stage_name / b.file).read_text(encoding="utf-8")
    planted = planted_source(b, reference, f"{stage_name}/{b.file}")
    lines = difflib.unified_diff(planted.splitlines(keepends=True),
                                 reference.splitlines(keepends=True),
                                 f"bug/{stage_name}/{b.file}", f"fixed/{stage_name}/{b.file}", n=2)
    return "".join(lines)


def planted_copy(stage_name: str, b: Bug, dst: Path) -> Path:
    """A copy of the reference stage at dst, with the bug planted (the package keeps its name
    when dst's last part is the stage's name, or is importable as dst.name otherwise)."""
    from common.exercise_workspace import COPY_IGNORE

    shutil.copytree(ROOT / stage_name, dst, ignore=COPY_IGNORE)
    plant(b, dst)
    return dst


# ---------------------------------------------------------------- running the check
def run_check(bugs: list[Bug], workspace_dir: Path | None, verbose: bool = False) -> list[dict]:
    """Each bug's check tests in one fresh interpreter, on the copy in `workspace_dir` (None: the
    course's stage) -> one result per bug: passed, tests, failed [{test, message}]."""
    nodes = sorted({n for b in bugs for n in b.checks})
    with tempfile.TemporaryDirectory() as tmp:
        # tests/bugs/conftest.py and tests/exercises/conftest.py each report the session they
        # are part of (either folder alone, or both)
        reports = [Path(tmp) / "bugs.json", Path(tmp) / "exercises.json"]
        paths = [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = dict(os.environ, SGLZ_BUG_REPORT=str(reports[0]),
                   SGLZ_EXERCISE_REPORT=str(reports[1]), PYTHONPATH=os.pathsep.join(paths))
        for name in ("SGLZ_EXERCISE_PROOF", "SGLZ_EXERCISE_ROOT", "SGLZ_EXERCISE_TASKS"):
            env.pop(name, None)
        if workspace_dir is not None:
            env["SGLZ_EXERCISE_ROOT"] = str(workspace_dir)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
               *nodes]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=not verbose)
        found = {}
        for report in [r for r in reports if r.exists()]:
            for o in json.loads(report.read_text()):
                if found.get(o["test"], {}).get("outcome") in (None, "passed"):
                    found[o["test"]] = o
        if not found:
            raise BugHuntError(f"the tests did not run:\n{proc.stdout or ''}{proc.stderr or ''}")
        outcomes = list(found.values())
    results = []
    for b in bugs:
        runs = {n: [o for o in outcomes if o["test"] == n or o["test"].startswith(n + "[")]
                for n in b.checks}  # a parametrized test: every case
        failed = [o for n in b.checks for o in runs[n] if o["outcome"] != "passed"]
        missing = [n for n in b.checks if not runs[n]]
        failed += [{"test": n, "outcome": "not run", "message": "the test was not found"}
                   for n in missing]
        results.append({"id": b.id, "passed": not failed, "tests": len(b.checks),
                        "failed": [{"test": o["test"].split("::")[-1],
                                    "message": o.get("message")} for o in failed]})
    return results


# ---------------------------------------------------------------- the symptom probe
def import_copy(folder: Path, name: str):
    """Import the stage package at folder/name (a copy), fresh."""
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    sys.path.insert(0, str(folder))
    try:
        importlib.invalidate_caches()
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def probe(b: Bug, pkg) -> tuple[bool, str]:
    """Run the bug's symptom probe on an imported stage package -> (symptom seen, what it saw)."""
    from common import bug_probes

    return getattr(bug_probes, b.probe)(pkg)


# ---------------------------------------------------------------- the commands
def status(b: Bug, state: dict) -> str:
    mine = state.get(STATE_KEY, {}).get(b.id)
    if mine is None:
        return "not planted"
    if "passed" not in mine:
        return "planted"
    return "fixed" if mine["passed"] else "planted, check fails"


def cmd_bugs(args, workspace) -> int:
    numbers = [args.stage] if args.stage is not None else sorted({b.stage for b in BUGS})
    for number in numbers:
        args.stage = number
        w = workspace(args)
        state = w.state()
        print(f"Stage {number}: {w.pkg.name}")
        for b in stage_bugs(number):
            print(f"  {b.id:<34} [{status(b, state)}]")
            print(textwrap.fill(b.symptom, 100, initial_indent=" " * 4, subsequent_indent=" " * 4))
        print()
    print(f"{len(BUGS)} bugs. `bug N ID` plants one in your copy ({w.dir.parent}); `bug N` a random "
          "one you have not fixed.")
    return 0


def cmd_bug(args, workspace, make_copy) -> int:
    w = workspace(args)
    state = w.state() if w.exists else {"stage": args.stage, "started": [], "results": {}}
    planted = state.setdefault(STATE_KEY, {})
    if args.tasks:
        chosen = [bug(t, args.stage) for t in args.tasks]
    else:
        open_bugs = [b for b in stage_bugs(args.stage) if b.id not in planted]
        if not open_bugs:
            raise BugHuntError(f"every bug of stage {args.stage} is planted already: `reset "
                               f"{args.stage}` takes them out")
        chosen = [random.choice(open_bugs)]
    if not w.exists:
        if w.dir.exists():
            raise BugHuntError(f"{w.dir} exists but is not a workspace; move it away first")
        make_copy(w.reference_pkg, w.pkg, [])
    for b in chosen:
        if b.id in planted:
            raise BugHuntError(f"bug {b.id} is planted already")
        plant(b, w.pkg)
        planted[b.id] = {"hints": 0}
    w.save(state)
    for b in chosen:
        print(f"Bug {b.id} is planted in your copy {w.pkg}.")
        print("A user reports:")
        print(textwrap.fill(b.symptom, 96, initial_indent='  "', subsequent_indent="   ") + '"')
    print(f"\nSee it: python -m common.exercises symptom {args.stage} ID; a step of the diagnosis: "
          f"hint {args.stage} ID;\nfixed? check {args.stage} ID (TROUBLESHOOTING.md has the "
          "symptoms and their causes)")
    return 0


def cmd_symptom(args, workspace) -> int:
    w = workspace(args)
    chosen = [bug(t, args.stage) for t in args.tasks] or stage_bugs(args.stage)
    pkg = import_copy(w.dir, w.pkg.name) if w.exists else importlib.import_module(w.pkg.name)
    where = "your copy" if w.exists else "the course's stage (no copy yet)"
    for b in chosen:
        seen, what = probe(b, pkg)
        print(f"{b.id} on {where}: {'SYMPTOM' if seen else 'no symptom'}\n  {what}")
    return 0


def cmd_hint(args, workspace) -> int:
    w = workspace(args)
    state = w.state()
    for name in args.tasks:
        b = bug(name, args.stage)
        mine = state.setdefault(STATE_KEY, {}).setdefault(b.id, {"hints": 0})
        shown = min(mine["hints"] + 1, len(b.hints))
        print(f"{b.id}: {b.symptom}")
        for i, step in enumerate(b.hints[:shown], 1):
            print(textwrap.fill(step, 98, initial_indent=f"  {i}. ", subsequent_indent="     "))
        more = len(b.hints) - shown
        print(f"  ({more} more: run hint again)" if more else "  (no more hints: `solution`)")
        mine["hints"] = shown
    if w.exists:
        w.save(state)
    return 0


def cmd_solution(args) -> int:
    from common.exercises import stage_of

    for name in args.tasks:
        b = bug(name, args.stage)
        print(f"# {b.id}: the planted change, and its fix (- the bug, + the reference)")
        print(diff(b, stage_of(args.stage).name))
    return 0


def cmd_reset(args, workspace, names: list[str]) -> int:
    """Take the named bugs (all planted ones when none is named) out of the copy."""
    w = workspace(args)
    state = w.state()
    planted = state.get(STATE_KEY, {})
    for b in [bug(n, args.stage) for n in names] if names else [BY_ID[i] for i in planted]:
        if unplant(b, w.pkg):
            print(f"{b.id}: the planted change taken out of {w.pkg / b.file}")
        else:
            print(f"{b.id}: not there as planted (fixed already, or edited); "
                  f"`solution {args.stage} {b.id}` shows what to restore")
        planted.pop(b.id, None)
    w.save(state)
    return 0


def cmd_check(args, workspace, names: list[str]) -> int:
    w = workspace(args)
    if not args.reference and not w.exists:
        raise BugHuntError(f"no workspace for stage {args.stage}: plant a bug first "
                           f"(`python -m common.exercises bug {args.stage}`)")
    state = w.state()
    planted = state.setdefault(STATE_KEY, {})
    chosen = [bug(n, args.stage) for n in names] if names else [BY_ID[i] for i in planted]
    results = run_check(chosen, None if args.reference else w.dir, args.verbose)
    if not args.reference:
        for r in results:
            planted.setdefault(r["id"], {"hints": 0})["passed"] = r["passed"]
            r["hints_used"] = planted[r["id"]].get("hints", 0)
        w.save(state)
    passed = sum(r["passed"] for r in results)
    if args.json:
        print(json.dumps({"stage": args.stage, "code": "reference" if args.reference else
                          str(w.pkg), "passed": passed, "total": len(results), "bugs": results},
                         indent=1))
        return 0 if passed == len(results) else 1
    for r in results:
        print(f"{'FIXED' if r['passed'] else 'FAIL '}  {r['id']}  ({r['tests']} tests)")
        for f in r["failed"][:1]:
            print(f"      {f['test']}:")
            for line in (f["message"] or "").splitlines()[:8]:
                print(f"        {line[:110]}")
    print(f"{passed}/{len(results)} bugs fixed")
    return 0 if passed == len(results) else 1
