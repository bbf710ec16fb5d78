"""Tests for common/stages.py, run against a throwaway git repo of tiny fake stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common import stages as tool  # noqa: E402

# engine.py: eight small functions, so that a fix at the top and one at the bottom don't overlap.
ENGINE = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(8))
INIT = "from .llm import LLM, SamplingParams\n"
LLM = "class LLM:\n    pass\n\n\nclass SamplingParams:\n    pass\n"


def notebook(stage: str) -> str:
    cell = {"cell_type": "code", "execution_count": 3, "metadata": {}, "source": [f"from {stage} import LLM"],
            "outputs": [{"output_type": "stream", "name": "stdout", "text": ["hello\n"]}]}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)


def git(root: Path, *args: str) -> None:
    ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", *ident, *args], cwd=root, check=True, capture_output=True)


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """stage1_a, stage2_b (engine.py diverged at the bottom, adds sched.py, drops old.py)
    and stage3_c (engine.py still identical to stage 1's, no util.py), all committed."""
    base = {"__init__.py": INIT, "llm.py": LLM, "engine.py": ENGINE, "util.py": "X = 1\n"}
    write(tmp_path, {f"stage1_a/{k}": v for k, v in base.items()})
    write(tmp_path, {"stage1_a/old.py": "OLD = 1\n", "stage1_a/README.md": "# Stage 1\n`python -m stage1_a`\n",
                     "stage1_a/__main__.py": 'USAGE = "python -m stage1_a"\n',
                     "stage1_a/stage1_a.ipynb": notebook("stage1_a"), "stage1_a/__pycache__/x.pyc": "junk"})
    write(tmp_path, {f"stage2_b/{k}": v for k, v in base.items()})
    write(tmp_path, {"stage2_b/engine.py": ENGINE.replace("return 7\n", "return 700\n"),
                     "stage2_b/sched.py": "def schedule():\n    return []\n",
                     "stage2_b/stage2_b.ipynb": notebook("stage2_b")})
    write(tmp_path, {f"stage3_c/{k}": v for k, v in base.items() if k != "util.py"})
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "fake stages")
    return tmp_path


def run(root: Path, *argv: str) -> int:
    return tool.main(["--root", str(root), *argv])


def stage(root: Path, name: str) -> tool.Stage:
    return tool.resolve_stage(tool.find_stages(root), name)


def test_list_and_resolve(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (repo / "stage9_nopkg").mkdir()  # no __init__.py: not a stage
    assert [s.name for s in tool.find_stages(repo)] == ["stage1_a", "stage2_b", "stage3_c"]
    assert stage(repo, "2").name == stage(repo, "stage2_b/").name == "stage2_b"
    assert run(repo, "list") == 0
    out = capsys.readouterr().out
    assert "stage1_a" in out and "8 files" in out  # __pycache__ not counted
    assert run(repo, "diff", "9") == 2


def test_diff_summary(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    diffs = {d.path: d for d in tool.diff_stages(stage(repo, "1"), stage(repo, "2"))}
    assert diffs["engine.py"].status == "changed" and (diffs["engine.py"].plus, diffs["engine.py"].minus) == (1, 1)
    assert diffs["sched.py"].status == "added" and diffs["sched.py"].plus == 2
    assert diffs["old.py"].status == "removed" and diffs["old.py"].minus == 1
    assert diffs["llm.py"].status == "identical"
    assert diffs["stage2_b.ipynb"].status == "changed" and diffs["stage2_b.ipynb"].note == "notebook"

    assert run(repo, "diff", "2") == 0  # previous stage vs stage 2
    out = capsys.readouterr().out
    assert "stage1_a -> stage2_b: 1 added, 3 removed, 2 changed, 3 identical" in out
    assert "+    return 700" in out and "+++ b/stage2_b/sched.py" in out
    assert '"cell_type"' not in out  # notebook JSON is never shown
    assert run(repo, "diff", "--stat") == 0  # every consecutive pair
    out = capsys.readouterr().out
    assert "stage1_a -> stage2_b" in out and "stage2_b -> stage3_c" in out and "@@" not in out


def test_carry_copies_and_merges(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(repo, {"stage1_a/engine.py": ENGINE.replace("return 0\n", "return 100\n"),
                 "stage1_a/util.py": "X = 2\n"})
    assert run(repo, "carry", "stage1_a/engine.py", "stage1_a/util.py") == 0
    out = capsys.readouterr().out
    stage2 = (repo / "stage2_b/engine.py").read_text()
    assert "return 100\n" in stage2 and "return 700\n" in stage2  # both changes kept
    assert (repo / "stage3_c/engine.py").read_text() == (repo / "stage1_a/engine.py").read_text()
    assert (repo / "stage2_b/util.py").read_text() == "X = 2\n"
    assert "stage2_b/engine.py: merged cleanly" in out and "stage3_c/engine.py: identical" in out
    assert "stage3_c/util.py: absent, skipped" in out
    assert run(repo, "carry", "stage1_a/llm.py") == 0
    assert "nothing to carry" in capsys.readouterr().out


def test_carry_conflict(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(repo, {"stage1_a/engine.py": ENGINE.replace("return 7\n", "return 7000\n")})
    assert run(repo, "carry", "stage1_a/engine.py") == 1
    out = capsys.readouterr().out
    assert "stage2_b/engine.py: CONFLICT: 1 conflict(s)" in out
    assert "<<<<<<< stage2_b/engine.py" in (repo / "stage2_b/engine.py").read_text()
    assert "return 7000" in (repo / "stage3_c/engine.py").read_text()


def test_carry_dry_run_writes_nothing(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(repo, {"stage1_a/engine.py": ENGINE.replace("return 7\n", "return 7000\n")})
    before = {p: p.read_bytes() for p in repo.rglob("*.py")}
    assert run(repo, "carry", "--dry-run", "stage1_a/engine.py") == 1  # the conflict is still reported
    assert {p: p.read_bytes() for p in repo.rglob("*.py")} == before
    assert "CONFLICT" in capsys.readouterr().out


def test_carry_committed_fix_and_all(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(repo, {"stage1_a/engine.py": ENGINE.replace("return 0\n", "return 100\n")})
    git(repo, "commit", "-q", "-am", "fix")
    write(repo, {"stage1_a/brand_new.py": "NEW = 1\n"})
    assert run(repo, "carry", "stage1_a/engine.py") == 0  # fix already committed: nothing vs HEAD
    assert "nothing to carry" in capsys.readouterr().out
    assert run(repo, "carry", "--stage", "1", "--all", "--from-rev", "HEAD~1") == 0
    out = capsys.readouterr().out
    assert "stage1_a/brand_new.py: untracked new file, not carried" in out
    assert "return 100\n" in (repo / "stage3_c/engine.py").read_text()
    assert not (repo / "stage2_b/brand_new.py").exists()
    assert run(repo, "carry", "--all") == 2  # --all needs --stage


def test_import_scan(repo: Path) -> None:
    write(repo, {"stage2_b/engine.py": "from stage1_a import x\nfrom common.models import resolve_model\n",
                 "stage2_b/llm.py": LLM + "\n\ndef load(name):\n    from common.models import resolve_model\n",
                 "stage2_b/__main__.py": "from common.models import resolve_model\nfrom .llm import LLM\n",
                 "stage3_c/llm.py": "import common.models\n" + LLM})
    problems = tool.scan_imports(stage(repo, "2"))
    assert len(problems) == 2
    assert problems[0].startswith("stage2_b/engine.py:1: imports stage package 'stage1_a'")
    assert problems[1].startswith("stage2_b/engine.py:2: imports 'common.models'")
    assert [p.split(": ")[0] for p in tool.scan_imports(stage(repo, "3"))] == ["stage3_c/llm.py:1"]
    assert tool.scan_imports(stage(repo, "1")) == []


def test_check_no_tests(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(repo, "check", "1", "--no-tests") == 0
    assert "check: 1 stage(s) ok" in capsys.readouterr().out
    write(repo, {"stage2_b/__init__.py": "from .llm import LLM\n", "stage2_b/sched.py": "import stage1_a\n"})
    assert run(repo, "check", "--no-tests", "stage2_b") == 1
    out = capsys.readouterr().out
    assert "import     FAILED: ImportError" in out and "stage2_b/sched.py:1: imports stage package" in out


def test_new_stage(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(repo, {"stage3_c/README.md": "# run `python -m stage3_c`\n",
                 "stage3_c/stage3_c.ipynb": notebook("stage3_c"), "stage3_c/__pycache__/y.pyc": "junk",
                 "stage3_c/engine.py": ENGINE + "# stage3_c stays here\n"})
    assert run(repo, "new", "4", "d") == 0
    new = repo / "stage4_d"
    assert (new / "README.md").read_text() == "# run `python -m stage4_d`\n"
    assert "stage3_c stays here" in (new / "engine.py").read_text()  # engine code is not rewritten
    assert not (new / "__pycache__").exists() and not (new / "stage3_c.ipynb").exists()
    cell = json.loads((new / "stage4_d.ipynb").read_text())["cells"][0]
    assert cell["source"] == ["from stage4_d import LLM"] and cell["outputs"] == []
    assert run(repo, "new", "4", "again") == 2  # stage 4 exists
    assert run(repo, "new", "6", "gap") == 2  # no stage 5 to copy
    assert "error:" in capsys.readouterr().err


def test_cli_entry_point(repo: Path) -> None:
    cmd = [sys.executable, "-m", "common.stages", "list", "--root", str(repo)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    assert "stage3_c" in proc.stdout
