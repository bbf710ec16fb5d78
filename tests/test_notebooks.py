"""Every stage's notebook executes top to bottom on a CPU (outputs are not kept: git holds clean notebooks)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from common.golden import discover_stages

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = [ROOT / s / "notebook.ipynb" for s in discover_stages()]


def test_every_stage_has_a_notebook_and_readme():
    for stage in discover_stages():
        assert (ROOT / stage / "notebook.ipynb").exists(), f"{stage} has no notebook.ipynb"
        assert (ROOT / stage / "README.md").exists(), f"{stage} has no README.md"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.parent.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path):
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    os.environ.setdefault("MPLBACKEND", "Agg")
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any failure
