"""Engine code stays within 100 columns, so that a stage reads side by side with its diff and on a laptop
screen (tables and diagrams in docstrings included)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_COLUMNS = 100


def test_engine_lines_fit_in_100_columns():
    long = [f"{p.relative_to(ROOT)}:{n}: {len(line)} columns"
            for p in sorted(ROOT.glob("stage*/**/*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_COLUMNS]
    assert not long, f"{len(long)} engine lines are longer than {MAX_COLUMNS} columns:\n" + "\n".join(long[:40])
