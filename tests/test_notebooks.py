"""Every stage's notebook is saved executed, so that a reader on a code host sees its numbers and plots; its cells
assert the milestones they show; and it still executes top to bottom on a CPU (a copy, in memory: the file is not
written). `python -m common.notebooks execute N` is the one command that re-executes and saves a notebook."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import nbformat
import pytest

from common import notebooks
from common.notebooks import (assert_count, execute_notebook, notebook_problems, quote_problems,
                              sync_quotes)
from common.stages import find_stages, new_stage

ROOT = Path(__file__).resolve().parent.parent
STAGES = find_stages(ROOT)
IDS = [s.name for s in STAGES]


def read(stage) -> nbformat.NotebookNode:
    return nbformat.read(stage.path / notebooks.NOTEBOOK, as_version=4)


def test_every_stage_has_a_notebook_and_readme():
    for stage in STAGES:
        assert (stage.path / "notebook.ipynb").exists(), f"{stage.name} has no notebook.ipynb"
        assert (stage.path / "README.md").exists(), f"{stage.name} has no README.md"


@pytest.mark.parametrize("stage", STAGES, ids=IDS)
def test_notebook_is_saved_executed(stage):
    problems = notebook_problems(read(stage), stage)
    assert not problems, f"{stage.name}/notebook.ipynb: " + "; ".join(problems)


@pytest.mark.parametrize("stage", STAGES, ids=IDS)
def test_notebook_asserts_its_milestones(stage):
    assert assert_count(read(stage)) > 0, (
        f"{stage.name}/notebook.ipynb has no assert in any code cell: what it prints is never checked")


@pytest.mark.parametrize("stage", STAGES, ids=IDS)
def test_notebook_executes(stage):
    path = stage.path / notebooks.NOTEBOOK
    before = path.read_bytes()
    nb = execute_notebook(path, ROOT)  # raises CellExecutionError, naming the cell, on any failure or failed assert
    assert path.read_bytes() == before, "executing in a test must not write the notebook"
    problems = notebook_problems(nb, stage)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("stage", STAGES, ids=IDS)
def test_readme_figures_are_lines_their_notebook_cell_printed(stage):
    readme = (stage.path / "README.md").read_text(encoding="utf-8")
    problems = quote_problems(readme, read(stage), f"{stage.name}/README.md")
    rewrite = f" (`python -m common.notebooks execute {stage.number}` rewrites them)"
    assert not problems, "; ".join(problems) + rewrite


# ---------------------------------------------------------------- the checker itself can fail


def test_a_new_stage_notebook_is_not_executed_and_the_failure_names_the_command(tmp_path, capsys):
    last = STAGES[-1]
    shutil.copytree(last.path, tmp_path / last.name, ignore=shutil.ignore_patterns("__pycache__"))
    created = new_stage(tmp_path, last.number + 1, "next")  # clears the copied notebook's outputs
    problems = notebook_problems(read(created), created)
    command = f"python -m common.notebooks execute {last.number + 1}"
    assert problems and "not saved executed" in problems[0] and command in problems[0], problems
    assert notebooks.main(["--root", str(tmp_path), "check", str(last.number + 1)]) == 1
    assert command in capsys.readouterr().out


def executed_by_hand() -> nbformat.NotebookNode:
    """A small notebook saved as `execute` saves one: counts 1..n, outputs, the digest of its code."""
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[v4.new_markdown_cell("# A lesson"), v4.new_code_cell("x = 2"),
                                v4.new_code_cell("print(x * 21)"), v4.new_code_cell("assert x * 21 == 42")])
    for n, cell in enumerate(nb.cells[1:], start=1):
        cell.execution_count = n
    nb.cells[2].outputs = [v4.new_output("stream", name="stdout", text="42\n")]
    notebooks.normalise(nb)
    return nb


def test_check_refuses_out_of_order_errors_edited_code_and_huge_outputs():
    stage = STAGES[0]
    good = executed_by_hand()
    assert not notebook_problems(good, stage)

    def broken(edit) -> list[str]:
        nb = copy.deepcopy(good)
        edit([c for c in nb.cells if c.cell_type == "code"])
        return notebook_problems(nb, stage)

    def swap_counts(cells):
        cells[0].execution_count, cells[1].execution_count = cells[1].execution_count, cells[0].execution_count

    assert "not executed top to bottom" in broken(swap_counts)[0]
    assert "not saved executed" in broken(lambda cells: setattr(cells[2], "execution_count", None))[0]
    error = nbformat.v4.new_output("error", ename="AssertionError", evalue="", traceback=[])
    assert any("error output: AssertionError" in p for p in broken(lambda cells: cells[2].outputs.append(error)))
    edited = broken(lambda cells: setattr(cells[1], "source", "print(x * 2)"))
    assert any("code changed since it was executed" in p for p in edited), edited
    huge = nbformat.v4.new_output("stream", name="stdout", text="x" * (notebooks.MAX_OUTPUT_TEXT + 1))
    problems = broken(lambda cells: cells[1].outputs.append(huge))
    assert any("stdout text output" in p and "print(x * 21)" in p for p in problems), problems
    for problems in (broken(swap_counts), edited):
        assert all(f"execute {stage.number}`" in p for p in problems), problems


def test_assert_count_parses_code():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('print("assert")  # assert x'),
                                         nbformat.v4.new_code_cell("%time x = 1\nassert x == 1, 'x'")])
    assert assert_count(nb) == 1


def test_execute_keeps_plots_under_mplbackend_agg_and_drops_machine_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # a CI default that would otherwise leave no plot in the notebook
    path = tmp_path / "plot.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]); plt.show()\nprint('done')")])
    nbformat.write(nb, path)
    before = path.read_bytes()
    out = execute_notebook(path, ROOT)
    assert path.read_bytes() == before
    outputs = out.cells[0].outputs
    assert any("image/png" in o.get("data", {}) for o in outputs), outputs
    assert "execution" not in out.cells[0].metadata  # no per-cell timing
    assert "version" not in out.metadata["language_info"]
    assert out.metadata["kernelspec"] == notebooks.KERNELSPEC


def test_a_quoted_figure_must_be_a_line_its_cell_printed_and_execute_rewrites_it():
    nb = executed_by_hand()  # cell In [2] printed "42"
    printed = nbformat.v4.new_output("stream", name="stdout", text="answer: 42\nunits: none\n")
    nb.cells[2].outputs = [printed]
    good = "| the answer | `answer: 42` <!-- notebook cell 2 --> |\n"
    assert quote_problems(good, nb) == []
    stale = good.replace("42", "41")
    (problem,) = quote_problems(stale, nb)
    assert "README.md:1" in problem and "'answer: 41'" in problem
    assert "it printed 'answer: 42'" in problem
    assert sync_quotes(stale, nb) == (good, 1) and sync_quotes(good, nb) == (good, 0)
    unknown = "`result: 41` <!-- notebook cell 2 -->"
    assert "no line of it starts 'result'" in quote_problems(unknown, nb)[0]
    assert sync_quotes(unknown, nb) == (unknown, 0)  # no line to take it from: the check reports it
    assert "does not have" in quote_problems("`answer: 42` <!-- notebook cell 9 -->", nb)[0]
