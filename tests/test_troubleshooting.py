"""TROUBLESHOOTING.md cannot rot: every command marked `# checked` in it runs here and succeeds on
the course's stages, it covers the symptoms the course promises, and every bug hunt it names
exists (and each bug's section names it back: tests/test_bug_hunts.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.bug_catalogue import BY_ID

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "TROUBLESHOOTING.md").read_text(encoding="utf-8")
SYMPTOMS = ["Out of memory", "Garbled output", "Repetition", "Slow generation",
            "Generation that never stops", "Results that change between runs, or with the batch",
            "A tensor-parallel rank that diverges", "Pages that leak after aborts",
            "A stream that stops mid-character", "A grammar that never completes",
            "bfloat16 output that drifts from float32", "A server that hangs at shutdown"]


def checked_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE, flags=re.S)
    return [line.strip().removesuffix("# checked").strip() for block in blocks
            for line in block.splitlines() if line.strip().endswith("# checked")]


def test_the_guide_covers_every_promised_symptom_and_real_bug_hunts():
    headings = re.findall(r"^## (.+)$", GUIDE, flags=re.M)
    for symptom in SYMPTOMS:
        assert symptom in headings, f"TROUBLESHOOTING.md has no section {symptom!r}"
    named = set(re.findall(r"`(\d\.[a-z0-9_]+)`", GUIDE))
    assert named and named <= set(BY_ID), f"unknown bug hunts: {named - set(BY_ID)}"
    assert "Measure before you optimise" in headings
    assert len(checked_commands()) >= 8


@pytest.mark.parametrize("command", checked_commands())
def test_checked_command_runs(command):
    args = shlex.split(command)
    assert args[0] == "python", "a checked command runs a course module"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    proc = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), "it says something"
