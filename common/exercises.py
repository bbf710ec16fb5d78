"""Exercise mode: write the engine's key functions yourself, and know when they are right.

    python -m common.exercises list [N]              every task: id, file and functions, goal, your status
    python -m common.exercises start N [TASK ...]    copy stage N to exercises/<stage>/ with those bodies stubbed
    python -m common.exercises check N [TASK ...]    run the tasks' tests on your copy (--json for grading)
    python -m common.exercises hint N TASK           what the function receives, returns and keeps; the README
    python -m common.exercises solution N TASK       the reference body
    python -m common.exercises reset N [TASK ...]    put the reference body back into your copy

TASK is `6.match_prefix` or just `match_prefix`. The workspace (git-ignored) is a copy of the stage package, so
your code runs the stage's real engine around it; the reference in stageN_x/ is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from common import exercise_workspace as ws
from common.exercise_tasks import BY_ID, TASKS, Task
from common.stages import Stage, find_stages

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "exercises"
STATE = "exercise.json"
BLOCKED = re.compile(r"exercise (\d+\.\w+):")


class ExerciseError(Exception):
    """A user mistake: printed as `error: ...`, exit status 2."""


def stage_of(number: int) -> Stage:
    for stage in find_stages(ROOT):
        if stage.number == number:
            return stage
    raise ExerciseError(f"there is no stage {number}")


def task(task_id: str, stage: int | None = None) -> Task:
    full = task_id if "." in task_id else f"{stage}.{task_id}"
    if full not in BY_ID:
        known = ", ".join(t.id for t in TASKS if stage is None or t.stage == stage)
        raise ExerciseError(f"no task {task_id!r}; the tasks are: {known}")
    found = BY_ID[full]
    if stage is not None and found.stage != stage:
        raise ExerciseError(f"task {found.id} belongs to stage {found.stage}, not {stage}")
    return found


def stage_tasks(number: int) -> list[Task]:
    return [t for t in TASKS if t.stage == number]


def stub_message(t: Task, qualname: str) -> str:
    return (f"{ws.STUB_PREFIX}{t.id}: {t.symbols[qualname]} Why: {stage_of(t.stage).name}/README.md, section "
            f"'{t.readme}'. Check: python -m common.exercises check {t.stage} {t.id}")


def stub_tasks(pkg: Path, tasks: list[Task]) -> None:
    by_file: dict[str, dict[str, str]] = {}
    for t in tasks:
        by_file.setdefault(t.file, {}).update({q: stub_message(t, q) for q in t.symbols})
    for file, messages in by_file.items():
        ws.stub_file(pkg / file, messages)


def make_copy(reference: Path, dst: Path, tasks: list[Task]) -> None:
    """A copy of a stage package at dst with the tasks' functions stubbed."""
    ws.copy_package(reference, dst)
    stub_tasks(dst, tasks)


def task_tests(number: int) -> dict[str, list[str]]:
    """task id -> the test functions marked with it in tests/exercises/stageN.py (read, not imported)."""
    import ast

    found: dict[str, list[str]] = {}
    tree = ast.parse((TESTS / f"stage{number}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        for dec in getattr(node, "decorator_list", []):
            if (isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "task" and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                found.setdefault(dec.args[0].value, []).append(node.name)
    return found


# ---------------------------------------------------------------- the workspace
class Workspace:
    def __init__(self, base: Path, stage: Stage):
        self.stage, self.dir = stage, base / stage.name
        self.pkg = self.dir / stage.name

    @property
    def exists(self) -> bool:
        return (self.dir / STATE).is_file()

    def state(self) -> dict:
        return json.loads((self.dir / STATE).read_text()) if self.exists else {"started": [], "results": {}}

    def save(self, state: dict) -> None:
        (self.dir / STATE).write_text(json.dumps(state, indent=1))

    def source(self, t: Task) -> str:
        return (self.pkg / t.file).read_text(encoding="utf-8")

    def reference(self, t: Task) -> str:
        return (self.stage.path / t.file).read_text(encoding="utf-8")

    def stale_files(self, state: dict) -> list[str]:
        """Files without a started task that differ from the course's stage (it changed since `start`)."""
        mine = {BY_ID[i].file for i in state["started"]}
        return [rel_path for path in sorted(self.stage.path.rglob("*.py"))
                if "__pycache__" not in path.parts
                and (rel_path := str(path.relative_to(self.stage.path))) not in mine
                and (not (self.pkg / rel_path).is_file() or (self.pkg / rel_path).read_bytes() != path.read_bytes())]

    def status(self, t: Task, state: dict) -> str:
        if not self.exists or t.id not in state["started"]:
            return "not started"
        try:
            source = self.source(t)
            if any(ws.is_stub(source, q) for q in t.symbols):
                return "todo"
        except ws.SourceError as e:
            return f"does not parse ({e})"
        last = state["results"].get(t.id)
        if last is None or last["digest"] != ws.digest(source, list(t.symbols)):
            return "written, not checked"
        return "pass" if last["passed"] else "fail"


def workspace_base(args) -> Path:
    return Path(args.dir or os.environ.get("SGLZ_EXERCISES_DIR") or ROOT / "exercises").resolve()


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def chosen(args, number: int) -> list[Task]:
    return [task(t, number) for t in args.tasks] if args.tasks else stage_tasks(number)


# ---------------------------------------------------------------- commands
def cmd_list(args) -> int:
    numbers = [args.stage] if args.stage is not None else sorted({t.stage for t in TASKS})
    for number in numbers:
        stage, tasks = stage_of(number), stage_tasks(number)
        w = Workspace(workspace_base(args), stage)
        state = w.state()
        where = f"workspace {rel(w.dir)}" if w.exists else "no workspace yet: start " + str(number)
        print(f"Stage {number}: {stage.name}  ({len(tasks)} tasks; {where})")
        for t in tasks:
            print(f"  {t.id:<28} [{w.status(t, state)}]  {t.file}: {', '.join(t.symbols)}")
            print(f"  {'':<28} {t.goal}")
        print()
    print(f"{len(TASKS)} tasks. Status: [todo] the stub is still there; [pass] / [fail] the last check, "
          "on the code as it is now.")
    return 0


def cmd_start(args) -> int:
    stage = stage_of(args.stage)
    w, tasks = Workspace(workspace_base(args), stage), chosen(args, args.stage)
    if w.exists and args.force:
        import shutil

        shutil.rmtree(w.dir)
    if not w.exists:
        if w.dir.exists():
            raise ExerciseError(f"{rel(w.dir)} exists but is not a workspace; move it away first")
        make_copy(stage.path, w.pkg, tasks)
        state = {"stage": stage.number, "started": [t.id for t in tasks], "results": {}}
    elif not args.tasks:
        raise ExerciseError(f"{rel(w.dir)} already exists. `start {stage.number} TASK` adds a task, `reset` puts "
                            "a reference body back, --force starts over (your code there is lost)")
    else:
        state = w.state()
        tasks = [t for t in tasks if t.id not in state["started"]]
        stub_tasks(w.pkg, tasks)
        state["started"] += [t.id for t in tasks]
    w.save(state)
    print(f"Workspace {rel(w.pkg)}: a copy of {stage.name}, imported instead of it when you check.")
    print("Write these functions (each body raises NotImplementedError with a hint until you do):")
    for t in tasks:
        print(f"  {t.id:<28} {rel(w.pkg / t.file)}: {', '.join(t.symbols)}")
    print(f"Then: python -m common.exercises check {stage.number}   (hint, solution and reset help)")
    return 0


def run_tests(stage: Stage, tasks: list[Task], workspace: Path | None, verbose: bool = False) -> list[dict]:
    """Run the tasks' tests in a fresh interpreter; -> one outcome per test (conftest.py's report)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, SGLZ_EXERCISE_TASKS=",".join(t.id for t in tasks), SGLZ_EXERCISE_REPORT=str(report),
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("SGLZ_EXERCISE_PROOF", None)
        env.pop("SGLZ_EXERCISE_ROOT", None)
        if workspace is not None:
            env["SGLZ_EXERCISE_ROOT"] = str(workspace)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
               str(TESTS / f"stage{stage.number}.py")]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=not verbose)
        if not report.exists():
            raise ExerciseError(f"the tests did not run:\n{(proc.stdout or '') + (proc.stderr or '')}")
        return json.loads(report.read_text())


def summarize(tasks: list[Task], outcomes: list[dict]) -> list[dict]:
    results = []
    for t in tasks:
        mine = [o for o in outcomes if o["task"] == t.id]
        failed = [o for o in mine if o["outcome"] == "failed"]
        blocked = sorted({m for o in failed for m in BLOCKED.findall(o.get("message") or "") if m != t.id})
        results.append({"id": t.id, "passed": bool(mine) and not failed, "tests": len(mine),
                        "failed": [{"test": o["test"].split("::")[-1], "location": o.get("location"),
                                    "message": o.get("message")} for o in failed],
                        "blocked_by": blocked})
    return results


def describe_failure(message: str, task_id: str, indent: str = "        ") -> str:
    """The first failure, wrapped; a stub of another task is named instead of quoting its whole hint."""
    other = BLOCKED.match(message.removeprefix("NotImplementedError: "))
    if other and other.group(1) != task_id:
        return f"{indent}it calls {other.group(1)}, still a stub: write that task first"
    lines = []
    for line in message.splitlines()[:15]:
        lines += textwrap.wrap(line, 100 - len(indent), subsequent_indent="  ") or [""]
    return "\n".join(indent + line for line in lines)


def cmd_check(args) -> int:
    stage = stage_of(args.stage)
    w = Workspace(workspace_base(args), stage)
    if not args.reference and not w.exists:
        raise ExerciseError(f"no workspace for stage {stage.number}: run `python -m common.exercises start "
                            f"{stage.number}` (or check --reference to test the course's own code)")
    state = w.state()
    tasks = [task(t, stage.number) for t in args.tasks] if args.tasks else (
        stage_tasks(stage.number) if args.reference else [BY_ID[i] for i in state["started"]])
    results = summarize(tasks, run_tests(stage, tasks, None if args.reference else w.dir, args.verbose))
    if not args.reference:
        for t, r in zip(tasks, results):
            state["results"][t.id] = {"passed": r["passed"], "digest": ws.digest(w.source(t), list(t.symbols))}
        w.save(state)
    passed = sum(r["passed"] for r in results)
    stale = [] if args.reference else w.stale_files(state)
    if stale and not args.json:
        print(f"note: {', '.join(stale[:4])}{' ...' if len(stale) > 4 else ''} in your copy differ from "
              f"{stage.name}/ (the course changed since `start`?): `start {stage.number} --force` makes a new copy")
    if args.json:
        print(json.dumps({"stage": stage.number, "code": "reference" if args.reference else str(w.pkg),
                          "passed": passed, "total": len(results), "tasks": results, "stale_files": stale},
                         indent=1))
    else:
        for r in results:
            print(f"{'PASS' if r['passed'] else 'FAIL'}  {r['id']}  ({r['tests']} tests"
                  + (f", {len(r['failed'])} failed)" if r["failed"] else ")"))
            for f in r["failed"][:1]:
                print(f"      {f['test']} ({f['location']}):")
                print(describe_failure(f["message"] or "", r["id"]))
        print(f"{passed}/{len(results)} tasks pass")
    return 0 if passed == len(results) else 1


def cmd_hint(args) -> int:
    stage = stage_of(args.stage)
    tests = task_tests(stage.number)
    for t in chosen(args, stage.number):
        print(f"{t.id}: {t.goal}\n  in {stage.name}/{t.file}; the idea: {stage.name}/README.md, '{t.readme}'")
        reference = (stage.path / t.file).read_text(encoding="utf-8")
        for qualname, hint in t.symbols.items():
            node = ws.find_def(ws.parse(reference), qualname)
            first, _ = ws.def_lines(node)
            head_end = ws.body_lines(reference.splitlines(), node)[0] - 1
            print(f"\n  {qualname}:\n" + "".join(reference.splitlines(keepends=True)[first - 1 : head_end]).rstrip())
            indent = " " * (node.col_offset + 4)
            print("\n".join(f"{indent}# {line}" for line in textwrap.wrap(hint, 96 - len(indent))))
        if t.needs:
            print(f"\n  its tests also run: {', '.join(t.needs)}")
        print(f"  tests: tests/exercises/stage{stage.number}.py: {', '.join(tests.get(t.id, []))}\n")
    return 0


def cmd_solution(args) -> int:
    stage = stage_of(args.stage)
    for t in chosen(args, stage.number):
        reference = (stage.path / t.file).read_text(encoding="utf-8")
        print(f"# {t.id}: {stage.name}/{t.file}")
        for qualname in t.symbols:
            print(ws.def_source(reference, qualname))
    return 0


def cmd_reset(args) -> int:
    stage = stage_of(args.stage)
    w = Workspace(workspace_base(args), stage)
    if not w.exists:
        raise ExerciseError(f"no workspace for stage {stage.number}: nothing to reset")
    state = w.state()
    tasks = chosen(args, stage.number) if args.tasks else [BY_ID[i] for i in state["started"]]
    for t in tasks:
        path = w.pkg / t.file
        path.write_text(ws.replace_defs(w.source(t), w.reference(t), list(t.symbols), str(path)),
                        encoding="utf-8")
        state["started"] = sorted(set(state["started"]) | {t.id})
        print(f"{t.id}: the reference {', '.join(t.symbols)} put back in {rel(path)}")
    w.save(state)
    return 0


def cmd_readme(args) -> int:
    print(readme_section(args.stage), end="")
    return 0


def readme_section(number: int) -> str:
    """The `## Exercises` section of a stage README, made from the catalogue (a test keeps them equal)."""
    intro = (f"Write this stage's key functions yourself: `python -m common.exercises start {number}` copies the "
             f"stage to `exercises/` with the bodies below replaced by a hint, and `python -m common.exercises "
             f"check {number}` runs their tests (`tests/exercises/stage{number}.py`) on your copy. How to take the "
             "course, and how a class is graded: [COURSE.md](../COURSE.md).")
    lines = ["## Exercises", "", *textwrap.wrap(intro, 115), "", "| task | write | goal |", "|---|---|---|"]
    for t in stage_tasks(number):
        symbols = ", ".join(f"`{s}`" for s in t.symbols)
        lines.append(f"| `{t.id}` | `{t.file}`: {symbols} | {t.goal} |")
    return "\n".join(lines) + "\n\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m common.exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where workspaces live (default: exercises/, or $SGLZ_EXERCISES_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="every task and its status")
    p.add_argument("stage", type=int, nargs="?")
    p.set_defaults(fn=cmd_list)
    for name, fn, helptext in [("start", cmd_start, "make your copy of a stage, the tasks stubbed"),
                               ("check", cmd_check, "run the tasks' tests on your copy"),
                               ("hint", cmd_hint, "what a task's functions take, return and keep"),
                               ("solution", cmd_solution, "print the reference functions"),
                               ("reset", cmd_reset, "put the reference functions back into your copy")]:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("stage", type=int)
        p.add_argument("tasks", nargs="*", metavar="TASK")
        p.set_defaults(fn=fn)
        if name == "start":
            p.add_argument("--force", action="store_true", help="start over: delete the workspace first")
        if name == "check":
            p.add_argument("--json", action="store_true", help="machine-readable results, for grading")
            p.add_argument("--reference", action="store_true", help="test the course's own stage instead")
            p.add_argument("--verbose", "-v", action="store_true", help="show pytest's own output")
    p = sub.add_parser("readme", help="print a stage README's Exercises section (from the catalogue)")
    p.add_argument("stage", type=int)
    p.set_defaults(fn=cmd_readme)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ExerciseError, ws.SourceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
