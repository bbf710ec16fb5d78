"""Exercise mode: write the engine's key functions yourself, and know when they are right.

    python -m common.exercises list [N]            every task: id, functions, goal, your status
    python -m common.exercises start N [TASK ...]  your copy of stage N, those bodies stubbed
    python -m common.exercises check N [TASK ...]  the tasks' tests on your copy (--json: grading;
                                                   a speed lesson is also timed: --speed, slow ones)
    python -m common.exercises hint N TASK         what it receives, returns, keeps; the README
    python -m common.exercises solution N TASK     the reference body
    python -m common.exercises reset N [TASK ...]  put the reference body back into your copy

Bug hunts (common/bug_hunts.py): `bugs [N]` lists them, `bug N [ID]` plants one in your copy and
tells its symptom, `symptom N ID` shows it; check, hint, solution and reset take a bug's ID too.

TASK is `6.match_prefix` or just `match_prefix`. Your copy (exercises/<stage>/, git-ignored) is the
whole stage package, so your functions run inside the stage's real engine; the course's stageN_x/
folders are never touched.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from common import bug_hunts, speed_checks
from common import exercise_workspace as ws
from common.exercise_tasks import BY_ID, TASKS, Task
from common.exercise_workspace import Workspace, make_copy, stub_tasks
from common.stages import Stage, find_stages

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "exercises"
BLOCKED = re.compile(r"exercise (\d+\.\w+):")  # a stub's message names its task

__all__ = ["BLOCKED", "main", "make_copy", "stage_of", "stage_tasks", "task", "task_tests"]


class ExerciseError(Exception):
    """A user mistake: printed as `error: ...`, exit status 2."""


def stage_of(number: int) -> Stage:
    for stage in find_stages(ROOT):
        if stage.number == number:
            return stage
    raise ExerciseError(f"there is no stage {number}")


def stage_tasks(number: int) -> list[Task]:
    return [t for t in TASKS if t.stage == number]


def task(task_id: str, stage: int | None = None) -> Task:
    full = task_id if "." in task_id else f"{stage}.{task_id}"
    if full not in BY_ID:
        known = ", ".join(t.id for t in TASKS if stage is None or t.stage == stage)
        raise ExerciseError(f"no task {task_id!r}; the tasks are: {known}")
    found = BY_ID[full]
    if stage is not None and found.stage != stage:
        raise ExerciseError(f"task {found.id} belongs to stage {found.stage}, not {stage}")
    return found


def task_tests(number: int) -> dict[str, list[str]]:
    """task id -> its test functions in tests/exercises/stageN.py (read, not imported)."""
    found: dict[str, list[str]] = {}
    tree = ast.parse((TESTS / f"stage{number}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        for dec in getattr(node, "decorator_list", []):
            if (isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "task"
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                found.setdefault(dec.args[0].value, []).append(node.name)
    return found


def workspace(args) -> Workspace:
    base = args.dir or os.environ.get("SGLZ_EXERCISES_DIR") or ROOT / "exercises"
    return Workspace(Path(base).resolve(), stage_of(args.stage).path)


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def in_order(ids: set[str]) -> list[str]:
    """Task ids in the catalogue's order (the order to write them in)."""
    return [t.id for t in TASKS if t.id in ids]


def bug_ids(args) -> list[str] | None:
    """The bug ids named (None: these are tasks); bugs and tasks in one command are refused."""
    names = getattr(args, "tasks", None) or []
    bugs = [n for n in names if bug_hunts.is_bug_id(n, args.stage)]
    if bugs and len(bugs) != len(names):
        raise ExerciseError("name tasks or bugs, not both in one command")
    return bugs or None


def chosen(args) -> list[Task]:
    return [task(t, args.stage) for t in args.tasks] if args.tasks else stage_tasks(args.stage)


# ---------------------------------------------------------------- running the tests
def run_tests(number: int, tasks: list[Task], root: Path | None, verbose: bool) -> list[dict]:
    """The tasks' tests in a fresh interpreter, on the copy in `root` (None: the course's stage);
    -> one outcome per test, as tests/exercises/conftest.py reports them."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        paths = [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = dict(os.environ, SGLZ_EXERCISE_TASKS=",".join(t.id for t in tasks),
                   SGLZ_EXERCISE_REPORT=str(report), PYTHONPATH=os.pathsep.join(paths))
        for name in ("SGLZ_EXERCISE_PROOF", "SGLZ_EXERCISE_ROOT"):
            env.pop(name, None)
        if root is not None:
            env["SGLZ_EXERCISE_ROOT"] = str(root)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
               str(TESTS / f"stage{number}.py")]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=not verbose)
        if not report.exists():
            raise ExerciseError(f"the tests did not run:\n{(proc.stdout or '')}{proc.stderr or ''}")
        return json.loads(report.read_text())


def summarize(tasks: list[Task], outcomes: list[dict]) -> list[dict]:
    results = []
    for t in tasks:
        mine = [o for o in outcomes if o["task"] == t.id]
        failed = [o for o in mine if o["outcome"] == "failed"]
        blocked = {m for o in failed for m in BLOCKED.findall(o.get("message") or "")} - {t.id}
        results.append({
            "id": t.id, "passed": bool(mine) and not failed, "tests": len(mine),
            "failed": [{"test": o["test"].split("::")[-1], "location": o.get("location"),
                        "message": o.get("message")} for o in failed],
            "blocked_by": sorted(blocked)})
    return results


def describe_failure(message: str, task_id: str, indent: str = "        ") -> str:
    """The first failure, wrapped; another task's stub is named rather than quoted whole."""
    other = BLOCKED.match(message.removeprefix("NotImplementedError: "))
    if other and other.group(1) != task_id:
        return f"{indent}it calls {other.group(1)}, still a stub: write that task first"
    lines = []
    for line in message.splitlines()[:15]:
        lines += textwrap.wrap(line, 100 - len(indent), subsequent_indent="  ") or [""]
    return "\n".join(indent + line for line in lines)


# ---------------------------------------------------------------- commands
def cmd_list(args) -> int:
    for number in [args.stage] if args.stage is not None else sorted({t.stage for t in TASKS}):
        args.stage = number
        w, tasks = workspace(args), stage_tasks(number)
        state = w.state()
        where = f"workspace {rel(w.dir)}" if w.exists else f"no workspace yet: start {number}"
        print(f"Stage {number}: {w.pkg.name}  ({len(tasks)} tasks; {where})")
        for t in tasks:
            print(f"  {t.id:<28} [{w.status(t, state)}]  {t.file}: {', '.join(t.symbols)}")
            print(f"  {'':<28} {t.goal}")
        print()
    print(f"{len(TASKS)} tasks. [todo]: the stub is still there; [pass] / [fail]: the last check, "
          "on the code as it is now.")
    return 0


def cmd_start(args) -> int:
    w, tasks = workspace(args), chosen(args)
    if w.exists and args.force:
        shutil.rmtree(w.dir)
    if not w.exists:
        if w.dir.exists():
            raise ExerciseError(f"{rel(w.dir)} exists but is not a workspace; move it away first")
        make_copy(w.reference_pkg, w.pkg, tasks)
        state = {"stage": args.stage, "started": [t.id for t in tasks], "results": {}}
    elif not args.tasks:
        raise ExerciseError(f"{rel(w.dir)} already exists. `start {args.stage} TASK` adds a task, "
                            "`reset` puts a reference body back, --force starts over (your code "
                            "there is lost)")
    else:
        state = w.state()
        tasks = [t for t in tasks if t.id not in state["started"]]
        stub_tasks(w.pkg, tasks)
        state["started"] = in_order(set(state["started"]) | {t.id for t in tasks})
    w.save(state)
    print(f"Workspace {rel(w.pkg)}: a copy of {w.pkg.name}, imported instead of it by check.")
    print("Write these functions (each body raises NotImplementedError with a hint until you do):")
    for t in tasks:
        print(f"  {t.id:<28} {rel(w.pkg / t.file)}: {', '.join(t.symbols)}")
    print(f"Then: python -m common.exercises check {args.stage}   (hint, solution, reset help)")
    return 0


def cmd_check(args) -> int:
    w = workspace(args)
    named, state = bug_ids(args), w.state()
    if named or (not args.tasks and not args.reference and w.exists and not state["started"]
                 and state.get(bug_hunts.STATE_KEY)):
        return bug_hunts.cmd_check(args, workspace, named or [])
    if not args.reference and not w.exists:
        raise ExerciseError(f"no workspace for stage {args.stage}: run `python -m common.exercises "
                            f"start {args.stage}` (or check --reference: the course's own code)")
    state = w.state()
    if args.tasks:
        tasks = chosen(args)
    else:
        tasks = stage_tasks(args.stage) if args.reference else [BY_ID[i] for i in state["started"]]
    outcomes = run_tests(args.stage, tasks, None if args.reference else w.dir, args.verbose)
    results = summarize(tasks, outcomes)
    stale = []
    if not args.reference:
        for t, r in zip(tasks, results):
            mine = ws.digest(w.source(t), list(t.symbols))
            state["results"][t.id] = {"passed": r["passed"], "digest": mine}
            # For a grader: the course's own code, as `reset` or a copied `solution` leaves it.
            r["same_as_reference"] = mine == ws.digest(w.reference(t), list(t.symbols))
        w.save(state)
        stale = w.stale_files(state)
    passed = sum(r["passed"] for r in results)
    # where the lesson is a speed-up: timed against what it replaces (common/speed_checks.py)
    speed = speed_checks.for_check(args.stage, results, not args.tasks,
                                   None if args.reference else w.dir, args.speed, args.verbose)
    ok = passed == len(results) and all(s["passed"] is not False for s in speed)
    if args.json:
        code = "reference" if args.reference else str(w.pkg)
        print(json.dumps({"stage": args.stage, "code": code, "passed": passed,
                          "total": len(results), "tasks": results, "speed": speed,
                          "stale_files": stale}, indent=1))
        return 0 if ok else 1
    if stale:
        shown = ", ".join(stale[:4]) + (" ..." if len(stale) > 4 else "")
        print(f"note: {shown} in your copy differ from {w.pkg.name}/ (the course changed since "
              f"`start`?): `start {args.stage} --force` makes a new copy")
    for r in results:
        failed = f", {len(r['failed'])} failed" if r["failed"] else ""
        print(f"{'PASS' if r['passed'] else 'FAIL'}  {r['id']}  ({r['tests']} tests{failed})")
        for f in r["failed"][:1]:
            print(f"      {f['test']}" + (f" ({f['location']}):" if f["location"] else ":"))
            print(describe_failure(f["message"] or "", r["id"]))
    print(f"{passed}/{len(results)} tasks pass")
    for s in speed:
        print(f"{speed_checks.LABELS[s['passed']]}  {s['message']}")
    return 0 if ok else 1


def cmd_hint(args) -> int:
    if bug_ids(args):
        return bug_hunts.cmd_hint(args, workspace)
    tests, folder = task_tests(args.stage), stage_of(args.stage).name
    for t in chosen(args):
        print(f"{t.id}: {t.goal}\n  in {folder}/{t.file}; why: {folder}/README.md, '{t.readme}'")
        reference = (stage_of(args.stage).path / t.file).read_text(encoding="utf-8")
        lines = reference.splitlines(keepends=True)
        for qualname, hint in t.symbols.items():
            node = ws.find_def(ws.parse(reference), qualname)
            first, _ = ws.def_lines(node)
            head_end = ws.body_lines(lines, node)[0] - 1  # the signature and the docstring
            print(f"\n  {qualname}:\n" + "".join(lines[first - 1 : head_end]).rstrip())
            indent = " " * (node.col_offset + 4)
            print("\n".join(f"{indent}# {line}" for line in textwrap.wrap(hint, 96 - len(indent))))
        if t.needs:
            print(f"\n  its tests also run: {', '.join(t.needs)}")
        names = f"tests/exercises/stage{args.stage}.py: {', '.join(tests.get(t.id, []))}"
        print(textwrap.fill(names, 98, initial_indent="  tests: ", subsequent_indent="    ") + "\n")
    return 0


def cmd_solution(args) -> int:
    if bug_ids(args):
        return bug_hunts.cmd_solution(args)
    stage = stage_of(args.stage)
    for t in chosen(args):
        reference = (stage.path / t.file).read_text(encoding="utf-8")
        print(f"# {t.id}: {stage.name}/{t.file}")
        for qualname in t.symbols:
            print(ws.def_source(reference, qualname))
    return 0


def cmd_reset(args) -> int:
    w = workspace(args)
    if not w.exists:
        raise ExerciseError(f"no workspace for stage {args.stage}: nothing to reset")
    named = bug_ids(args)
    if named or not args.tasks:  # every planted bug when nothing is named
        bug_hunts.cmd_reset(args, workspace, named or [])
        if named:
            return 0
    state = w.state()
    for t in chosen(args) if args.tasks else [BY_ID[i] for i in state["started"]]:
        path = w.pkg / t.file
        restored = ws.replace_defs(w.source(t), w.reference(t), list(t.symbols), str(path))
        path.write_text(restored, encoding="utf-8")
        state["started"] = in_order(set(state["started"]) | {t.id})
        print(f"{t.id}: the reference {', '.join(t.symbols)} put back in {rel(path)}")
    w.save(state)
    return 0


def readme_section(number: int) -> str:
    """A stage README's `## Exercises` section, made from the catalogue (a test keeps it equal)."""
    intro = (f"Write this stage's key functions yourself: `python -m common.exercises start "
             f"{number}` copies the stage to `exercises/` with the bodies below replaced by a "
             "hint, "
             f"and `python -m common.exercises check {number}` runs their tests "
             f"(`tests/exercises/stage{number}.py`) on your copy. How to take the course, and how "
             "a class is graded: [COURSE.md](../COURSE.md).")
    lines = ["## Exercises", "", *textwrap.wrap(intro, 115), "",
             "| task | write | goal |", "|---|---|---|"]
    for t in stage_tasks(number):
        symbols = ", ".join(f"`{s}`" for s in t.symbols)
        lines.append(f"| `{t.id}` | `{t.file}`: {symbols} | {t.goal} |")
    return "\n".join(lines) + "\n\n"


def cmd_readme(args) -> int:
    print(readme_section(args.stage), end="")
    return 0


COMMANDS = [("start", cmd_start, "make your copy of a stage, the tasks' bodies stubbed"),
            ("check", cmd_check, "run the tasks' tests on your copy"),
            ("hint", cmd_hint, "what a task's functions receive, return and keep"),
            ("solution", cmd_solution, "print the reference functions"),
            ("reset", cmd_reset, "put the reference functions back into your copy"),
            ("bug", lambda a: bug_hunts.cmd_bug(a, workspace, make_copy),
             "plant a bug in your copy; it tells the symptom"),
            ("symptom", lambda a: bug_hunts.cmd_symptom(a, workspace),
             "show a planted bug's symptom on your copy")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m common.exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where workspaces live (default exercises/, or "
                                      "$SGLZ_EXERCISES_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="every task and its status")
    p.add_argument("stage", type=int, nargs="?")
    p.set_defaults(fn=cmd_list)
    for name, fn, helptext in COMMANDS:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("stage", type=int)
        p.add_argument("tasks", nargs="*", metavar="TASK")
        p.set_defaults(fn=fn)
    sub.choices["start"].add_argument("--force", action="store_true",
                                      help="start over: delete the workspace first")
    check = sub.choices["check"]
    check.add_argument("--json", action="store_true", help="machine-readable results, for grading")
    check.add_argument("--reference", action="store_true", help="test the course's own stage")
    check.add_argument("--verbose", "-v", action="store_true", help="show pytest's own output")
    check.add_argument("--speed", action="store_true",
                       help="also the slow speed checks (5: compiles the decode step)")
    p = sub.add_parser("bugs", help="every bug hunt: id, symptom, status")
    p.add_argument("stage", type=int, nargs="?")
    p.set_defaults(fn=lambda a: bug_hunts.cmd_bugs(a, workspace))
    p = sub.add_parser("readme", help="print a stage README's Exercises section")
    p.add_argument("stage", type=int)
    p.set_defaults(fn=cmd_readme)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `check 6 --json evict`: tasks after an option
        if not hasattr(args, "tasks") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.tasks += extra
    try:
        return args.fn(args)
    except (ExerciseError, ws.SourceError, bug_hunts.BugHuntError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head`: the reader left, say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
