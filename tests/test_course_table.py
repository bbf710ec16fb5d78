"""COURSE.md's table of lesson sizes is the one `python -m common.course_table` computes from the stage
folders today: when a stage's README or code changes, this fails until `--write` regenerates it."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.course_table import COURSE_MD, END, START, lesson_sizes, markdown_table, table_in, with_table
from common.stages import find_stages

ROOT = Path(__file__).resolve().parent.parent


def test_course_md_table_is_the_generated_one():
    written = table_in((ROOT / COURSE_MD).read_text(encoding="utf-8"))
    assert written == markdown_table(ROOT), (
        "COURSE.md's lesson-size table is stale: run `python -m common.course_table --write`")


def test_sizes_are_counted_from_the_stage_folders():
    sizes = lesson_sizes(ROOT)
    stages = find_stages(ROOT)
    assert [s.stage.number for s in sizes] == [s.number for s in stages]
    first = stages[0]
    code = [p for p in first.path.rglob("*.py") if "__pycache__" not in p.parts]
    assert sizes[0].code_added == sum(len(p.read_text(encoding="utf-8").splitlines()) for p in code)
    for size in sizes:
        readme = size.stage.path / "README.md"
        assert size.readme_lines == len(readme.read_text(encoding="utf-8").splitlines())
        assert size.code_added > 0 and size.tasks > 0
        if size.core is not None:  # a chapter with a lesson map: its parts share out every added line
            assert size.core + size.optional <= size.code_added


def test_write_replaces_only_the_table():
    text = f"# head\n\n{START}\n| old |\n{END}\n\ntail\n"
    new = with_table(text, "| new |")
    assert table_in(new) == "| new |"
    assert new.startswith("# head\n\n") and new.endswith("\n\ntail\n")
    with pytest.raises(ValueError):
        table_in("no markers here")
