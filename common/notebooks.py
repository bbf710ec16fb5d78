"""Run the stage notebooks and keep them saved executed, so that a reader sees each lesson's numbers and plots.

    python -m common.notebooks execute [STAGE ...]   run each notebook top to bottom on the CPU, save it with outputs
    python -m common.notebooks check [STAGE ...]     check that each is saved executed: every code cell ran, in
                                                     order, no error, no huge output, code unchanged since it ran

STAGE is a number (2) or a folder name (stage2_batch); default: every stage. A notebook's cells assert the facts
they show, so executing one also tests it; tests/test_notebooks.py runs `check` on the saved files and executes a
copy of each in memory. Re-run `execute` after changing a notebook's code or the engine code it shows, and commit
the result: that is the one command that writes the notebooks.

A stage README quotes a figure from its notebook as one whole line that a code cell printed,
in backticks, followed by the cell's number (its `In [N]`):

    `fitted slopes, 32-128 tokens: no cache 1.34, KV cache 1.01` <!-- notebook cell 8 -->

`check` fails when the quote is not a line of that cell's output; `execute` rewrites each quote
with the line the new run printed under the same label (the text before the first ": "), so the
README cannot drift from the run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.stages import DEFAULT_ROOT, Stage, StageError, find_stages, resolve_stage

NOTEBOOK = "notebook.ipynb"
KERNEL = "python3"
CELL_TIMEOUT_S = 900  # generous: a cell that takes longer is hung, not slow
MAX_OUTPUT_TEXT = 100_000  # characters of text in one output: more is a runaway print, not a lesson
MAX_OUTPUT_IMAGE = 500_000  # base64 characters of one image
MAX_NOTEBOOK_BYTES = 1_500_000
METADATA_KEY = "sglang_from_zero"  # notebook metadata written by `execute`: {"code_sha256": ...}
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": KERNEL}
README = "README.md"
QUOTE = re.compile(r"`([^`\n]+)`\s*<!-- notebook cell (\d+) -->")  # quoted from cell In [N]


def notebook_path(stage: Stage) -> Path:
    return stage.path / NOTEBOOK


def execute_command(stage: Stage) -> str:
    return f"python -m common.notebooks execute {stage.number}"


def kernel_env() -> dict[str, str]:
    """The kernel's environment: this one, on the CPU, with inline plots."""
    env = dict(os.environ)
    # ipykernel picks the inline backend only when MPLBACKEND is unset; an inherited Agg would save no plot.
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the notebooks show the CPU run, whatever the machine has
    env["TRITON_INTERPRET"] = "1"  # so that Triton kernels can run on the CPU (set before triton is imported)
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' bars are widgets: a code host cannot draw them
    # Without ipywidgets, tqdm.auto warns in a kernel that it cannot draw widgets: we draw none.
    quiet = "ignore:IProgress not found"
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), quiet]))
    return env


def code_sha256(nb) -> str:
    """A digest of the code cells' sources: `check` compares it with the one saved by `execute`."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode("utf-8") + b"\0")
    return digest.hexdigest()


def normalise(nb) -> None:
    """Drop what differs between machines and runs (kernel version, timing), record the code that ran."""
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    if "language_info" in nb.metadata:
        nb.metadata["language_info"].pop("version", None)  # the Python patch level of whoever ran it
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata[METADATA_KEY] = {"code_sha256": code_sha256(nb)}


def execute_notebook(path: Path, root: Path = DEFAULT_ROOT, timeout: int = CELL_TIMEOUT_S):
    """Run the notebook at `path` top to bottom in a fresh kernel (cwd = root) and return it with its outputs; the
    file is not written. A failing cell raises nbclient's CellExecutionError, which shows the cell and traceback."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, record_timing=False, store_widget_state=False,
                            coalesce_streams=True,  # one stdout and one stderr per cell, progress bars' \r applied
                            extra_arguments=["--log-level=ERROR"],  # no kernel start-up chatter on our stderr
                            resources={"metadata": {"path": str(root)}})
    client.execute(env=kernel_env())
    normalise(nb)
    return nb


def notebook_text(nb) -> str:
    import nbformat

    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def _cell_name(index: int, cell) -> str:
    first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
    return f"cell {index + 1} ({first[:50]!r})"


def _output_sizes(out) -> list[tuple[str, int, int]]:
    """(kind, size, limit) of every part of one output."""
    if out.output_type == "stream":
        return [(f"{out.name} text", len(out.text), MAX_OUTPUT_TEXT)]
    parts = []
    for mime, value in out.get("data", {}).items():
        image = mime.startswith("image/") and mime != "image/svg+xml"
        parts.append((mime, len(value if isinstance(value, str) else str(value)),
                      MAX_OUTPUT_IMAGE if image else MAX_OUTPUT_TEXT))
    return parts


def size_problems(nb) -> list[str]:
    """Outputs and notebooks too large to keep in git and read on a code host."""
    problems = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            for kind, size, limit in _output_sizes(out):
                if size > limit:
                    problems.append(f"{_cell_name(i, cell)} has a {kind} output of {size:,} characters (limit "
                                    f"{limit:,}): print less")
    size = len(notebook_text(nb).encode("utf-8"))
    if size > MAX_NOTEBOOK_BYTES:
        problems.append(f"the notebook is {size:,} bytes with its outputs (limit {MAX_NOTEBOOK_BYTES:,}): print "
                        "less, or plot smaller figures")
    return problems


def notebook_problems(nb, stage: Stage) -> list[str]:
    """Why the notebook is not a faithful record of one top-to-bottom run; empty when it is."""
    problems, not_run, out_of_order = [], [], []
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if not code:
        problems.append("it has no code cell")
    for n, (i, cell) in enumerate(code, start=1):
        if not cell.source.strip():
            problems.append(f"{_cell_name(i, cell)} is an empty code cell: delete it")
        elif cell.execution_count is None:
            not_run.append(i + 1)
        elif cell.execution_count != n:
            out_of_order.append(f"{i + 1} (In [{cell.execution_count}], expected {n})")
        for out in cell.outputs:
            if out.output_type == "error":
                problems.append(f"{_cell_name(i, cell)} has an error output: {out.ename}: {out.evalue}")
    rerun = f"run `{execute_command(stage)}` and commit the notebook"
    if not_run:
        problems.insert(0, f"not saved executed (code cells {', '.join(map(str, not_run))} of the notebook have "
                           f"no output count); {rerun}")
    if out_of_order:
        problems.insert(0, f"not executed top to bottom in one run (cells {', '.join(out_of_order)}); {rerun}")
    saved = nb.metadata.get(METADATA_KEY, {}).get("code_sha256")
    if not not_run and saved != code_sha256(nb):
        why = "its code changed since it was executed" if saved else "it was not executed by this tool"
        problems.append(f"the outputs may not belong to the code: {why}; {rerun}")
    return problems + size_problems(nb)


def assert_count(nb) -> int:
    """How many `assert` statements the code cells hold (parsed, so comments and strings do not count)."""
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        try:
            count += sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(source)))
        except SyntaxError:
            continue
    return count


# ------------------------------------------------------ README figures quoted from the notebook


def printed_lines(nb, count: int) -> list[str] | None:
    """The stdout lines of the code cell that ran as In [count]; None if no cell did."""
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.execution_count == count:
            text = "".join(o.text for o in cell.outputs
                           if o.output_type == "stream" and o.name == "stdout")
            return [line.rstrip() for line in text.splitlines()]
    return None


def label(line: str) -> str:
    """What a figure line is about: the text before its first ": " (or the whole line)."""
    return line.split(": ", 1)[0]


def quote_problems(readme: str, nb, name: str = README) -> list[str]:
    """Each figure the README quotes from the notebook that is not a line its cell printed."""
    problems = []
    for n, line in enumerate(readme.splitlines(), start=1):
        for m in QUOTE.finditer(line):
            quote, count = m.group(1), int(m.group(2))
            lines = printed_lines(nb, count)
            if lines is None:
                problems.append(f"{name}:{n} quotes notebook cell {count}, which the notebook "
                                "does not have")
            elif quote not in lines:
                same = [x for x in lines if label(x) == label(quote)]
                shows = (f"it printed {same[0]!r}" if same
                         else f"no line of it starts {label(quote)!r}")
                problems.append(f"{name}:{n} quotes {quote!r} from notebook cell {count}, "
                                f"but {shows}")
    return problems


def sync_quotes(readme: str, nb) -> tuple[str, int]:
    """The README with each quoted figure replaced by the line its cell printed under the same
    label (where exactly one such line exists), and how many quotes changed."""
    changed = 0

    def replace(m: re.Match) -> str:
        nonlocal changed
        quote, lines = m.group(1), printed_lines(nb, int(m.group(2))) or []
        same = [x for x in lines if label(x) == label(quote)]
        if quote in lines or len(same) != 1:
            return m.group(0)  # current, or not decidable: `check` reports what is wrong
        changed += 1
        return m.group(0).replace(f"`{quote}`", f"`{same[0]}`", 1)

    return QUOTE.sub(replace, readme), changed


@dataclass
class Chosen:
    stage: Stage
    path: Path

    @property
    def name(self) -> str:
        return f"{self.stage.name}/{NOTEBOOK}"


def choose(root: Path, specs: list[str]) -> list[Chosen]:
    stages = find_stages(root)
    chosen = [resolve_stage(stages, spec) for spec in specs] if specs else stages
    if not chosen:
        raise StageError(f"no stage folders in {root}")
    missing = [s.name for s in chosen if not notebook_path(s).is_file()]
    if missing:
        raise StageError(f"no {NOTEBOOK} in {', '.join(missing)}")
    return [Chosen(s, notebook_path(s)) for s in chosen]


def cmd_execute(root: Path, args: argparse.Namespace) -> int:
    from nbclient.exceptions import CellExecutionError

    failed = []
    for c in choose(root, args.stages):
        start = time.perf_counter()
        try:
            nb = execute_notebook(c.path, root, args.timeout)
        except CellExecutionError as err:
            print(f"FAILED {c.name} after {time.perf_counter() - start:.1f} s, not saved:\n{err}")
            failed.append(c.name)
            continue
        seconds = time.perf_counter() - start
        problems = size_problems(nb)
        if problems:
            print(f"FAILED {c.name}: executed in {seconds:.1f} s, not saved: " + "; ".join(problems))
            failed.append(c.name)
            continue
        text = notebook_text(nb)
        c.path.write_text(text, encoding="utf-8")
        cells = sum(cell.cell_type == "code" for cell in nb.cells)
        print(f"executed {c.name} in {seconds:.1f} s: {cells} code cells, {len(text.encode()) / 1e3:.0f} kB saved")
        readme = c.stage.path / README
        if readme.is_file():
            synced, changed = sync_quotes(readme.read_text(encoding="utf-8"), nb)
            if changed:
                readme.write_text(synced, encoding="utf-8")
                print(f"  {c.stage.name}/{README}: {changed} figure(s) quoted from the notebook "
                      "updated to this run")
    if failed:
        print(f"execute: FAILED {', '.join(failed)}")
    return 1 if failed else 0


def cmd_check(root: Path, args: argparse.Namespace) -> int:
    import nbformat

    failed = []
    for c in choose(root, args.stages):
        nb = nbformat.read(c.path, as_version=4)
        problems = notebook_problems(nb, c.stage)
        readme = c.stage.path / README
        if readme.is_file():
            text = readme.read_text(encoding="utf-8")
            problems += quote_problems(text, nb, f"{c.stage.name}/{README}")
        if problems:
            failed.append(c.name)
            print(f"FAILED {c.name}: " + "\n  ".join(problems))
        else:
            cells = sum(cell.cell_type == "code" for cell in nb.cells)
            print(f"ok     {c.name}: {cells} code cells executed in order, {assert_count(nb)} asserts, "
                  f"{c.path.stat().st_size / 1e3:.0f} kB")
    if failed:
        print(f"check: FAILED {', '.join(failed)}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m common.notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="repository root (default: this checkout)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    stage_help = "a stage number (2) or folder name (stage2_batch); default: every stage"
    p = sub.add_parser("execute", help="run notebooks top to bottom on the CPU and save them with outputs",
                       description="Run each notebook in a fresh python3 kernel (cwd = the repository root, on the "
                       "CPU, inline PNG plots) and save it with its outputs, without timing metadata. A failing "
                       "cell, or an output over the size limits, leaves the file as it was. Exit 1 on failure.")
    p.add_argument("stages", nargs="*", metavar="STAGE", help=stage_help)
    p.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help=f"seconds per cell (default {CELL_TIMEOUT_S})")
    p.set_defaults(func=cmd_execute)
    p = sub.add_parser("check", help="check that notebooks are saved executed",
                       description="Every code cell ran, in order, in one run of `execute` on the code as saved; no "
                       "error output; outputs and file within the size limits; every figure the "
                       "stage README quotes from the notebook is a line its cell printed. Exit 1 "
                       "on failure.")
    p.add_argument("stages", nargs="*", metavar="STAGE", help=stage_help)
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args.root.resolve(), args))
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
