"""The lesson map (common/stage_parts.py, `python -m common.stages parts N`): every chapter's added
code lines belong to exactly one named part, parts stay readable, and the READMEs follow them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common import stage_parts, stages  # noqa: E402

CHAPTERS = [s.number for s in stages.find_stages(REPO)]

ENGINE_1 = "def prefill():\n    return 1\n\n\nclass Engine:\n    def step(self):\n        return 1\n"
ENGINE_2 = ("import os\n\n\ndef prefill():\n    return 2\n\n\nclass Engine:\n    def step(self):\n"
            "        x = 2\n        return x\n\n    def run(self):\n        return 3\n")


def toml_part(pid: str, kind: str, claims: list[str]) -> str:
    return f'[[part]]\nid = "{pid}"\ntitle = "part {pid}"\nkind = "{kind}"\nclaims = {json.dumps(claims)}\n'


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name, engine, doc in (("stage1_a", ENGINE_1, "One request."), ("stage2_b", ENGINE_2, "A batch.")):
        (tmp_path / name / "kernels").mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text(f'"""{doc}"""\n')
        (tmp_path / name / "engine.py").write_text(engine)
    (tmp_path / "stage2_b" / "kernels" / "fast.cpp").write_text("int f() {\n  return 1;\n}\n")
    (tmp_path / "stage2_b" / "README.md").write_text("# not code\n" * 50)
    (tmp_path / "common" / "parts").mkdir(parents=True)
    return tmp_path


def declare(root: Path, number: int, *parts: str) -> None:
    (root / "common" / "parts" / f"stage{number}.toml").write_text("\n".join(parts))


def test_most_precise_claim_owns_each_line(repo: Path) -> None:
    declare(repo, 2, toml_part("2.1", "core", ["engine.py", "engine.py::Engine.run"]),
            toml_part("2.2", "optional", ["kernels", "engine.py::Engine.step", "__init__.py"]))
    chapter = stage_parts.map_chapter(repo, 2)
    core, fast = chapter.parts
    # engine.py adds "import os" and two blank lines (module), "return 2" (prefill), two lines of step,
    # a blank line in class Engine, two lines of run
    assert fast.symbols == {"kernels/fast.cpp": 3, "engine.py::Engine.step": 2, "__init__.py": 1}
    assert core.symbols["engine.py::Engine.run"] == 2 and core.symbols["engine.py::prefill"] == 1
    assert core.lines_added + fast.lines_added == chapter.lines_added and not chapter.unclaimed
    assert not chapter.problems  # README.md is not code: not counted


def test_unclaimed_duplicates_limits_and_unknown_claims_are_reported(repo: Path) -> None:
    declare(repo, 2, toml_part("2.1", "core", ["engine.py::Engine", "engine.py::Nope"]),
            toml_part("2.3", "fancy", ["engine.py::Engine", "missing.py"]))
    chapter = stage_parts.map_chapter(repo, 2)
    assert "kernels/fast.cpp:1" in chapter.unclaimed and "engine.py:1" in chapter.unclaimed
    text = "\n".join(chapter.problems)
    for expected in ("expected id 2.2", "'fancy' is not one of", "'engine.py::Engine' is in parts 2.1 and 2.3",
                     "'engine.py::Nope' names no", "'missing.py' names no"):
        assert expected in text
    assert stages.main(["--root", str(repo), "parts", "2"]) == 1


def test_part_over_its_size_limit_is_refused(repo: Path) -> None:
    (repo / "stage2_b" / "big.py").write_text("X = 1\n" * 301)
    declare(repo, 2, toml_part("2.1", "core", ["engine.py", "kernels", "__init__.py", "big.py"]))
    assert any("adds 314 lines, over 300" in p for p in stage_parts.map_chapter(repo, 2).problems)
    declare(repo, 2, toml_part("2.1", "optional", ["engine.py", "kernels", "__init__.py", "big.py"]))
    assert not stage_parts.map_chapter(repo, 2).problems


def test_first_chapter_is_the_whole_first_stage(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    declare(repo, 1, toml_part("1.1", "core", ["engine.py", "__init__.py"]))
    assert stages.main(["--root", str(repo), "parts", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unclaimed"] == 0 and out["lines_added"] == ENGINE_1.count("\n") + 1
    assert out["parts"][0]["symbols"] == ["__init__.py", "engine.py", "engine.py::Engine", "engine.py::Engine.step",
                                          "engine.py::prefill"]


def test_diff_shows_one_part_or_the_core(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    declare(repo, 2, toml_part("2.1", "core", ["engine.py", "__init__.py"]),
            toml_part("2.2", "optional", ["kernels", "engine.py::Engine.run"]))
    assert stages.main(["--root", str(repo), "diff", "1", "2", "--part", "2.2"]) == 0
    only_fast = capsys.readouterr().out
    assert "+  return 1;" in only_fast and "+    def run(self):" in only_fast and "import os" not in only_fast
    assert stages.main(["--root", str(repo), "diff", "1", "2", "--core"]) == 0
    core = capsys.readouterr().out
    assert "+import os" in core and "fast.cpp" not in core
    assert stages.main(["--root", str(repo), "diff", "1", "2", "--part", "2.9"]) == 2
    assert "no part 2.9" in capsys.readouterr().err


def test_check_fails_on_a_file_that_differs_only_by_a_stage_name(repo: Path) -> None:
    for name, number in (("stage1_a", 1), ("stage2_b", 2)):
        (repo / name / "tokens.py").write_text(f'"""Used by stage {number}\'s engine."""\nX = 1\n')
    (repo / "stage1_a" / "llm.py").write_text("class LLM: pass\nclass SamplingParams: pass\n")
    (repo / "stage2_b" / "llm.py").write_text("class LLM: pass\nclass SamplingParams: pass\n")
    b = stages.resolve_stage(stages.find_stages(repo), "2")
    a = stages.resolve_stage(stages.find_stages(repo), "1")
    assert stage_parts.name_only_differences(a, b) == ["tokens.py"]
    assert stages.main(["--root", str(repo), "check", "--no-tests"]) == 1


@pytest.mark.parametrize("number", CHAPTERS)
def test_every_added_line_of_the_chapter_belongs_to_one_part(number: int) -> None:
    chapter = stage_parts.map_chapter(REPO, number)
    assert not chapter.problems, "\n".join(chapter.problems)
    assert not chapter.unclaimed, f"{len(chapter.unclaimed)} unclaimed, e.g. {chapter.unclaimed[:10]}"
    assert sum(p.lines_added for p in chapter.parts) == chapter.lines_added
    assert any(p.kind == "core" for p in chapter.parts)


@pytest.mark.parametrize("number", CHAPTERS)
def test_the_stage_readme_follows_its_parts_in_order(number: int) -> None:
    chapter = stage_parts.map_chapter(REPO, number)
    headings = [line for line in (chapter.new.path / "README.md").read_text().splitlines()
                if line.startswith("#")]
    found = []
    for part in chapter.parts:
        at = [i for i, h in enumerate(headings) if re.search(rf"(?<![\d.]){re.escape(part.id)}(?![\d])", h)]
        assert at, f"{chapter.new.name}/README.md has no heading naming part {part.id} ({part.title})"
        found.append(at[0])
    assert found == sorted(found), f"{chapter.new.name}/README.md's part sections are out of order"


def test_no_stage_file_differs_from_the_stage_before_only_by_its_name() -> None:
    found = stages.find_stages(REPO)
    noise = {b.name: stage_parts.name_only_differences(a, b) for a, b in zip(found, found[1:])}
    assert not any(noise.values()), noise


@pytest.mark.parametrize("number", CHAPTERS)
def test_the_stage_readme_is_a_lesson_not_a_log(number: int) -> None:
    """At most 350 lines: benchmark history lives in PERFORMANCE.md, not in the lesson."""
    stage = stages.resolve_stage(stages.find_stages(REPO), str(number))
    lines = (stage.path / "README.md").read_text().count("\n")
    assert lines <= 350, f"{stage.name}/README.md has {lines} lines"
