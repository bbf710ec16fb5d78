"""The size of each lesson, counted from the stage folders, for COURSE.md.

A hand-written table of README lengths and diff sizes goes stale as soon as a stage changes, so this
one is computed: per stage, the lines of its README, the code lines its chapter adds, counted as the
lesson map counts them (`python -m common.stages parts N`: the added lines of a line diff against the
stage before, over code files only: READMEs, notebooks and figures are not code), split into core and
optional parts, and the number of exercise tasks.

    python -m common.course_table           # print the markdown table
    python -m common.course_table --write   # put it into COURSE.md, between the markers

tests/test_course_table.py fails when COURSE.md's copy differs from a fresh one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from common.exercise_tasks import TASKS
from common.stage_parts import chapter_files, map_chapter
from common.stages import DEFAULT_ROOT, Stage, StageError, find_stages

START = "<!-- course-table:start -->"
END = "<!-- course-table:end -->"
COURSE_MD = "COURSE.md"


@dataclass(frozen=True)
class LessonSize:
    stage: Stage
    readme_lines: int
    code_added: int  # lines the chapter's code diff adds (chapter 1: all of stage 1's code)
    core: int | None  # of those, the lines of its core parts; None without a lesson map
    optional: int | None
    tasks: int


def lesson_size(root: Path, stage: Stage, before: Stage | None) -> LessonSize:
    """README lines, and the code lines the chapter (the diff `before` -> `stage`) adds."""
    added = sum(len(lines) for lines in chapter_files(before, stage).values())
    try:
        parts = map_chapter(root, stage.number).parts
        core = sum(p.lines_added for p in parts if p.kind == "core")
        optional = sum(p.lines_added for p in parts if p.kind == "optional")
    except StageError:  # no common/parts/stageN.toml yet
        core = optional = None
    readme = (stage.path / "README.md").read_text(encoding="utf-8")
    tasks = sum(1 for task in TASKS if task.stage == stage.number)
    return LessonSize(stage, len(readme.splitlines()), added, core, optional, tasks)


def lesson_sizes(root: Path = DEFAULT_ROOT) -> list[LessonSize]:
    stages = find_stages(root)
    return [lesson_size(root, stage, before) for before, stage in zip([None, *stages], stages)]


def markdown_table(root: Path = DEFAULT_ROOT) -> str:
    rows = ["| stage | README lines | code lines the chapter adds | in core parts | in optional parts "
            "| exercise tasks |", "|---|---|---|---|---|---|"]
    for size in lesson_sizes(root):
        split = [str(n) if n is not None else "no lesson map" for n in (size.core, size.optional)]
        rows.append(f"| {size.stage.number} [`{size.stage.name}`]({size.stage.name}/README.md) | "
                    f"{size.readme_lines} | {size.code_added} | {split[0]} | {split[1]} | {size.tasks} |")
    return "\n".join(rows)


def table_in(text: str) -> str:
    """The table between the markers of a COURSE.md text; ValueError without the markers."""
    if START not in text or END not in text:
        raise ValueError(f"{COURSE_MD} lacks the markers {START} and {END}")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def with_table(text: str, table: str) -> str:
    """`text` with the part between the markers replaced by `table`."""
    table_in(text)  # the markers must be there
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {COURSE_MD} in place")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the course's root folder")
    args = parser.parse_args(argv)
    table = markdown_table(args.root)
    if not args.write:
        print(table)
        return 0
    path = args.root / COURSE_MD
    text = path.read_text(encoding="utf-8")
    new = with_table(text, table)
    if new != text:
        path.write_text(new, encoding="utf-8")
    print(f"{COURSE_MD}: table {'rewritten' if new != text else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
