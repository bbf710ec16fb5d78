"""Keep the stage snapshots of "SGLang from Zero" maintainable.

Every `stage<N>_<name>/` folder is a complete, self-contained engine, and stage N+1 starts
life as a copy of stage N. Copies are easy to read but easy to let drift: this tool shows
what each lesson changed, checks that stages stay independent, carries a fix down to the
later stages and starts new ones. `python -m common.stages COMMAND --help` for details.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parent.parent
STAGE_RE = re.compile(r"^stage(\d+)_(\w+)$")
IGNORED_DIRS = ("__pycache__", ".ipynb_checkpoints", ".pytest_cache")
GOLDEN_TESTS = "tests/test_golden.py"
RENAME_IN = ("README.md", "__main__.py")  # files (besides notebooks) where `new` renames the package


class StageError(Exception):
    """A user mistake: printed as `error: ...` without a traceback, exit status 2."""


@dataclass(frozen=True)
class Stage:
    number: int
    name: str  # folder name == package name, e.g. "stage2_batch"
    path: Path


def find_stages(root: Path) -> list[Stage]:
    """Folders `stage<N>_<name>/` that contain `__init__.py`, sorted by N."""
    found = [(STAGE_RE.match(folder.name), folder) for folder in root.iterdir()]
    stages = [Stage(int(m.group(1)), f.name, f) for m, f in found if m and (f / "__init__.py").is_file()]
    return sorted(stages, key=lambda s: s.number)


def resolve_stage(stages: list[Stage], spec: str) -> Stage:
    """A stage given as a number ("2") or a folder name ("stage2_batch")."""
    spec = spec.rstrip("/")
    found = [s for s in stages if spec == s.name or (spec.isdigit() and int(spec) == s.number)]
    if found:
        return found[0]
    raise StageError(f"no stage {spec!r} (existing: {', '.join(s.name for s in stages) or 'none'})")


def stage_files(folder: Path) -> list[str]:
    """Paths of the files in a stage, relative to it, without caches."""
    paths = [p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and p.suffix != ".pyc"]
    return sorted(p.as_posix() for p in paths if not set(IGNORED_DIRS) & set(p.parts))


def cmd_list(root: Path, args: argparse.Namespace) -> int:
    for stage in find_stages(root):
        print(f"{stage.number:>3}  {stage.name:<24} {len(stage_files(stage.path)):>3} files")
    return 0


def _read_lines(path: Path | None) -> list[str]:
    """A text file's lines, none for a missing file; UnicodeDecodeError for a binary file."""
    return path.read_bytes().decode("utf-8").splitlines(keepends=True) if path else []


@dataclass
class FileDiff:
    status: str  # "added", "removed", "changed" or "identical"
    path: str  # path inside the stage (the newer stage's spelling when it has the file)
    plus: int = 0
    minus: int = 0
    note: str = ""  # "notebook" or "binary": no unified text is shown
    text: list[str] = field(default_factory=list)


def diff_stages(a: Stage, b: Stage) -> list[FileDiff]:
    """Compare two stages file by file. A file named after its stage (the notebook
    `stage1_naive.ipynb`) is matched with its renamed copy (`stage2_batch.ipynb`)."""
    old = {rel.replace(a.name, "{stage}"): rel for rel in stage_files(a.path)}
    new = {rel.replace(b.name, "{stage}"): rel for rel in stage_files(b.path)}
    diffs: list[FileDiff] = []
    for key in sorted(old.keys() | new.keys()):
        rel_a, rel_b = old.get(key), new.get(key)
        path_a, path_b = (a.path / rel_a if rel_a else None), (b.path / rel_b if rel_b else None)
        if path_a and path_b:
            status = "identical" if path_a.read_bytes() == path_b.read_bytes() else "changed"
        else:
            status = "removed" if path_a else "added"
        diffs.append(diff := FileDiff(status, rel_b or rel_a or key))
        if status == "identical":
            continue
        try:
            lines_a, lines_b = _read_lines(path_a), _read_lines(path_b)
        except UnicodeDecodeError:
            diff.note = "binary"
            continue
        name_a = f"a/{a.name}/{rel_a}" if rel_a else "/dev/null"
        name_b = f"b/{b.name}/{rel_b}" if rel_b else "/dev/null"
        text = list(difflib.unified_diff(lines_a, lines_b, name_a, name_b))
        diff.plus = sum(line.startswith("+") for line in text[2:])
        diff.minus = sum(line.startswith("-") for line in text[2:])
        # Notebook JSON diffs are unreadable: count them, but show only .py/.md/... text.
        diff.note, diff.text = ("notebook", []) if key.endswith(".ipynb") else ("", text)
    return diffs


def format_summary(a: Stage, b: Stage, diffs: list[FileDiff]) -> str:
    count = {s: sum(1 for d in diffs if d.status == s) for s in ("added", "removed", "changed", "identical")}
    shown = [d for d in diffs if not d.note]  # notebook JSON line counts would mean nothing
    head = ", ".join(f"{n} {status}" for status, n in count.items())
    head += f" (+{sum(d.plus for d in shown)} -{sum(d.minus for d in shown)} lines)"
    lines = [f"{a.name} -> {b.name}: {head}"]
    for d in diffs:
        if d.status != "identical":
            counts = f"{d.note}, diff not shown" if d.note else f"+{d.plus} -{d.minus}"
            lines.append(f"  {d.status:<9} {d.path:<36} {counts}")
    same = [d.path for d in diffs if d.status == "identical"]
    return "\n".join(lines + ([f"  identical {', '.join(same)}"] if same else []))


def cmd_diff(root: Path, args: argparse.Namespace) -> int:
    stages = find_stages(root)
    chosen = [resolve_stage(stages, spec) for spec in args.stages]
    if len(chosen) > 2:
        raise StageError("diff takes at most two stages")
    if len(chosen) == 1:  # `diff 3`: the stage before 3 vs 3
        chosen = [s for s in stages if s.number < chosen[0].number][-1:] + chosen
        if len(chosen) == 1:
            raise StageError(f"{chosen[0].name} is the first stage; nothing to diff against")
    if args.part or args.core:
        return print_part_diff(root, stages, chosen, args)
    for a, b in [(chosen[0], chosen[1])] if chosen else zip(stages, stages[1:]):
        diffs = diff_stages(a, b)
        print(format_summary(a, b, diffs))
        if not args.stat:
            for line in (line for d in diffs for line in d.text):
                sys.stdout.write(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
        print()
    return 0


def print_part_diff(root: Path, stages: list[Stage], chosen: list[Stage], args: argparse.Namespace) -> int:
    """`diff N-1 N --part N.k` / `--core`: only the hunks of the chosen parts of chapter N."""
    from .stage_parts import map_chapter, part_diff

    if len(chosen) != 2 or [s for s in stages if s.number < chosen[1].number][-1:] != chosen[:1]:
        raise StageError("--part and --core show one chapter: name two consecutive stages (diff 3 4)")
    number = chosen[1].number
    wanted = set(args.part or []) | ({p.id for p in map_chapter(root, number).parts if p.kind == "core"}
                                     if args.core else set())
    for line in part_diff(root, number, wanted):
        print(line)
    return 0


def cmd_parts(root: Path, args: argparse.Namespace) -> int:
    from .stage_parts import format_chapter, map_chapter

    chapter = map_chapter(root, resolve_stage(find_stages(root), args.stage).number)
    print(json.dumps(chapter.as_json(), indent=1) if args.json else format_chapter(chapter))
    return 1 if chapter.problems or chapter.unclaimed else 0


def _absolute_imports(node: ast.AST, in_function: bool = False) -> Iterator[tuple[int, str, bool]]:
    """(line, module, inside_a_function) for every non-relative import below `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield child.lineno, alias.name, in_function
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            yield child.lineno, child.module, in_function
        is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        yield from _absolute_imports(child, in_function or is_function)


def scan_imports(stage: Stage) -> list[str]:
    """Imports that break a stage's independence, as `file:line: message`.

    Stage code uses relative imports only, never `stageM_*` (any M, its own name included,
    since the folder is copied and renamed). `common` may be imported only in `__main__.py`
    and lazily, inside a function, in `llm.py` (model-name resolution)."""
    problems: list[str] = []
    for rel in (f for f in stage_files(stage.path) if f.endswith(".py")):
        where = f"{stage.name}/{rel}"
        try:
            tree = ast.parse((stage.path / rel).read_bytes(), filename=where)
        except SyntaxError as err:
            problems.append(f"{where}:{err.lineno}: syntax error: {err.msg}")
            continue
        for line, module, in_function in _absolute_imports(tree):
            top = module.split(".")[0]
            if STAGE_RE.match(top):
                problems.append(f"{where}:{line}: imports stage package '{module}' (use relative imports)")
            elif top == "common" and not (rel == "__main__.py" or (rel == "llm.py" and in_function)):
                allowed = "allowed only in __main__.py and inside a function in llm.py"
                problems.append(f"{where}:{line}: imports '{module}' ({allowed})")
    return problems


def import_error(root: Path, stage: Stage) -> str | None:
    """Import the stage in a fresh interpreter; None on success, else the error's last line."""
    code = f"import {stage.name}; from {stage.name} import LLM, SamplingParams"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["crashed"])[-1]


def golden_tests(root: Path, stage: Stage) -> tuple[bool, str]:
    """Run the golden tests selected by the stage's name; (passed, what to show)."""
    if not (root / GOLDEN_TESTS).is_file():
        return False, f"{GOLDEN_TESTS} not found (use --no-tests to skip)"
    cmd = [sys.executable, "-m", "pytest", "-q", GOLDEN_TESTS, "-k", stage.name]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip().splitlines() or [""]
    if proc.returncode == 5:
        return False, f"no golden test matches -k {stage.name}"
    return proc.returncode == 0, out[-1] if proc.returncode == 0 else "\n".join(out[-25:])


def name_only_noise(stages: list[Stage], stage: Stage) -> list[str]:
    from .stage_parts import name_only_differences

    before = [s for s in stages if s.number < stage.number]
    return name_only_differences(before[-1], stage) if before else []


def cmd_check(root: Path, args: argparse.Namespace) -> int:
    stages = find_stages(root)
    chosen = [resolve_stage(stages, s) for s in args.stages] if args.stages else stages
    failed: list[str] = []
    for stage in chosen:
        print(stage.name)
        error = import_error(root, stage)
        print(f"  import     {'ok' if error is None else 'FAILED: ' + error}")
        problems = scan_imports(stage)
        print(f"  isolation  {'ok' if not problems else f'{len(problems)} violation(s)'}")
        for problem in problems:
            print(f"    {problem}")
        noise = name_only_noise(stages, stage)
        print(f"  names      {'ok' if not noise else f'{len(noise)} file(s) differ only by a stage name'}")
        for rel in noise:
            print(f"    {stage.name}/{rel}")
        ok = error is None and not problems and not noise
        if not args.no_tests:
            passed, report = golden_tests(root, stage)
            print(f"  golden     {'ok: ' if passed else 'FAILED: '}" + report.replace("\n", "\n    "))
            ok = ok and passed
        if not ok:
            failed.append(stage.name)
    print(f"check: FAILED {', '.join(failed)}" if failed else f"check: {len(chosen)} stage(s) ok")
    return 1 if failed else 0


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True)


def merge_file(ours: Path, base: bytes, theirs: bytes, labels: tuple[str, str, str]) -> tuple[bytes, int]:
    """`git merge-file -p ours base theirs`: (merged text, number of conflicts)."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "base").write_bytes(base)
        Path(tmp, "theirs").write_bytes(theirs)
        cmd = ["git", "merge-file", "-p", "-L", labels[0], "-L", labels[1], "-L", labels[2], str(ours)]
        proc = subprocess.run([*cmd, str(Path(tmp, "base")), str(Path(tmp, "theirs"))], capture_output=True)
    if not 0 <= proc.returncode <= 127:
        raise StageError(f"git merge-file failed on {ours}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout, proc.returncode


def carry_file(root: Path, stages: list[Stage], rel: str, rev: str, dry_run: bool) -> int:
    """Carry the change of `rel` since `rev` into the same file of every later stage.
    Returns the number of problems: conflicts, or a file that cannot be carried."""
    stage_name, _, inner = rel.partition("/")
    source = resolve_stage(stages, stage_name)
    if not (root / rel).is_file():
        print(f"{rel}: not a file in the working tree (deletions are not carried); skipped")
        return 1
    shown = _git(root, "show", f"{rev}:./{rel}")  # the version before the fix
    if shown.returncode != 0:
        print(f"{rel}: not in {rev}, so there is no old version to merge against; not carried")
        return 1
    before, new = shown.stdout, (root / rel).read_bytes()
    if new == before:
        print(f"{rel}: unchanged since {rev}, nothing to carry")
        return 0
    print(f"{rel}: carrying the change since {rev}{' (dry run: nothing is written)' if dry_run else ''}")
    problems = 0
    for stage in (s for s in stages if s.number > source.number):
        target = stage.path / inner
        result: bytes | None = None
        if not target.is_file():
            status = "absent, skipped"
        elif target.read_bytes() == new:
            status = "already has the fix"
        elif target.read_bytes() == before:
            result, status = new, "identical to the old version: copied"
        else:
            labels = (f"{stage.name}/{inner}", f"{rel} at {rev}", rel)
            result, conflicts = merge_file(target, before, new, labels)
            problems += 1 if conflicts else 0
            status = f"CONFLICT: {conflicts} conflict(s)" if conflicts else "merged cleanly"
        if result is not None and not dry_run:
            target.write_bytes(result)
        print(f"  {stage.name}/{inner}: {status}")
    return problems


def changed_in_stage(root: Path, stage: Stage, rev: str) -> list[str]:
    """Tracked files of the stage changed since `rev`; untracked new files are only reported."""
    diff = _git(root, "diff", "--name-only", "--relative", "-z", rev, "--", f"{stage.name}/")
    if diff.returncode != 0:
        raise StageError(f"git diff failed: {diff.stderr.decode(errors='replace').strip()}")
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", f"{stage.name}/")
    for rel in sorted(filter(None, untracked.stdout.decode().split("\0"))):
        print(f"{rel}: untracked new file, not carried (copy it by hand if later stages need it)")
    changed = sorted(filter(None, diff.stdout.decode().split("\0")))
    print(f"{stage.name}: {len(changed)} file(s) changed since {rev}")
    return changed


def cmd_carry(root: Path, args: argparse.Namespace) -> int:
    stages = find_stages(root)
    if args.all != (args.stage is not None) or not (args.files or args.all):
        raise StageError("name the FILE(s) to carry, or use --stage N --all")
    files = [Path(name).as_posix() for name in args.files]  # relative to the repo root
    if args.all:
        files += changed_in_stage(root, resolve_stage(stages, args.stage), args.from_rev)
    problems = sum(carry_file(root, stages, rel, args.from_rev, args.dry_run) for rel in files)
    if problems:
        written = "" if args.dry_run else "; conflicts are left as <<<<<<< markers to resolve by hand"
        print(f"carry: {problems} problem(s) above{written}")
    return 1 if problems else 0


def _clear_outputs(text: str) -> str:
    """A notebook without outputs and execution counts (text unchanged if not valid JSON)."""
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError:
        return text
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def new_stage(root: Path, number: int, name: str) -> Stage:
    """Create `stage<number>_<name>/` as a copy of stage number-1."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise StageError(f"bad stage name {name!r}: use letters, digits and _")
    stages = find_stages(root)
    target = Stage(number, f"stage{number}_{name}", root / f"stage{number}_{name}")
    taken = [s.name for s in stages if s.number == number] + ([target.name] if target.path.exists() else [])
    if taken:
        raise StageError(f"refusing to overwrite: {', '.join(sorted(set(taken)))} already exists")
    source = resolve_stage(stages, str(number - 1))  # the stage to copy
    shutil.copytree(source.path, target.path, ignore=shutil.ignore_patterns(*IGNORED_DIRS, "*.pyc"))
    for path in sorted(target.path.rglob("*")):
        if path.is_file() and (path.suffix == ".ipynb" or path.name in RENAME_IN):
            if path.name == f"{source.name}.ipynb":
                path = path.rename(path.with_name(f"{target.name}.ipynb"))
            text = path.read_bytes().decode("utf-8").replace(source.name, target.name)
            path.write_bytes((_clear_outputs(text) if path.suffix == ".ipynb" else text).encode("utf-8"))
    return target


def cmd_new(root: Path, args: argparse.Namespace) -> int:
    stage = new_stage(root, args.number, args.name)
    print(f"created {stage.name}/ from stage {args.number - 1}; now edit its README.md and write the lesson, then "
          f"save its notebook executed: python -m common.notebooks execute {stage.number}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    shared = argparse.ArgumentParser(add_help=False)  # so --root works before or after the command
    shared.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="repository root holding the stage folders (default: this checkout)")
    parser = argparse.ArgumentParser(prog="python -m common.stages", parents=[shared], description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: object, summary: str, details: str = "") -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[shared], help=summary, description=f"{summary}. {details}".strip())
        p.set_defaults(func=func)
        return p

    stage_help = "a stage number (2) or folder name (stage2_batch)"
    command("list", cmd_list, "List the stages in order, with file counts")
    p = command("diff", cmd_diff, "Show what a lesson changed", "A summary of files added / removed / changed / "
                "identical, then the unified diff (notebooks: summary only). `diff 3` = previous stage vs 3.")
    p.add_argument("stages", nargs="*", metavar="STAGE", help=stage_help)
    p.add_argument("--stat", action="store_true", help="print only the summary")
    p.add_argument("--part", action="append", metavar="N.K", help="only this part's hunks (repeatable)")
    p.add_argument("--core", action="store_true", help="only the hunks of the chapter's core parts")
    p = command("parts", cmd_parts, "List a chapter's lesson map: its parts in reading order",
                "Chapter N is the diff stage N-1 -> N, its parts declared in common/parts/stageN.toml. Per "
                "part: id, kind (core/optional), lines added, the definitions it adds or changes. Exit 1 if "
                "a line is unclaimed or a part breaks a rule (core <= 300 lines, optional <= 600).")
    p.add_argument("stage", metavar="N", help=stage_help)
    p.add_argument("--json", action="store_true", help='{"parts": [...], "unclaimed": N, ...}')
    p = command("check", cmd_check, "Check that stages are standalone and pass the golden tests",
                "Per stage (default: all): import it in a fresh interpreter, scan its .py files for imports "
                f"of stage packages or `common`, run `pytest -q {GOLDEN_TESTS} -k <stage>`. Exit 1 on failure.")
    p.add_argument("stages", nargs="*", metavar="STAGE", help=stage_help)
    p.add_argument("--no-tests", action="store_true", help="skip the golden tests")
    p = command("carry", cmd_carry, "Carry a fix in one stage down to every later stage",
                "A later stage's copy equal to `git show REV:FILE` is replaced; a diverged copy gets a "
                "three-way merge (git merge-file). Conflicts are left as markers and make the exit status 1.")
    p.add_argument("files", nargs="*", metavar="FILE", help="e.g. stage2_batch/engine.py (from the repo root)")
    p.add_argument("--from-rev", default="HEAD", metavar="REV",
                   help="revision holding the version before the fix (default HEAD: the fix is uncommitted)")
    p.add_argument("--dry-run", action="store_true", help="report what would happen, write nothing")
    p.add_argument("--stage", metavar="N", help="with --all: the stage whose changed files to carry")
    p.add_argument("--all", action="store_true", help="carry every tracked file of --stage changed since REV")
    p = command("new", cmd_new, "Create stage N as a copy of stage N-1",
                "Copies without caches, renames a notebook named after the old stage, clears notebook "
                "outputs, renames the package in README.md, __main__.py and notebooks. Refuses if N exists.")
    p.add_argument("number", type=int, metavar="N")
    p.add_argument("name", metavar="NAME", help="lesson name, e.g. batch -> stage2_batch/")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = Path(getattr(args, "root", DEFAULT_ROOT)).resolve()
    try:
        return int(args.func(root, args))
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
