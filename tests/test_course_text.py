"""The learner-facing text speaks of the course: what the code does and what was measured. Words about how the
course is being written (work items, sessions, lent machines, rooms of a package) mean nothing to a reader and
are caught here, in every README, notebook and the GPU script."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_ABOUT_THE_COURSE = re.compile(
    r"the issue|issue's|issue [0-9]|\bsessions?\b|\bthe brief\b|\blent\b|\bthis task\b|tasks only|"
    r"\bgpu_carry\b|carried along|rooms? of|\| room \||within 10 minutes",
    re.IGNORECASE,
)


def learner_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "COURSE.md", *ROOT.glob("stage*/README.md"),
             *ROOT.glob("stage*/*.ipynb"), *ROOT.glob("common/*.sh")]
    return [f for f in files if f.exists()]


def test_learner_text_speaks_of_the_course():
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
            for f in learner_files()
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            if NOT_ABOUT_THE_COURSE.search(line)]
    assert not hits, "lines about how the course is made, not about the course:\n" + "\n".join(hits)


def test_the_check_finds_what_it_looks_for():
    assert NOT_ABOUT_THE_COURSE.search("GPU figures pending (this session had no GPU)")
    assert NOT_ABOUT_THE_COURSE.search("| room | change |")
    assert not NOT_ABOUT_THE_COURSE.search("a decode step issues one token per running request")
