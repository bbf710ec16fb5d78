"""The benchmark support code: its module structure, the peers' runners and the profile, rehearsed on tiny models.
Timings here mean nothing (speed is shown by the benchmarks themselves); what is checked is that each part runs,
reports what it measured, and compares tokens honestly."""

from __future__ import annotations

import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parent.parent / "common"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "common":
                names |= {f"common.{alias.name}" for alias in node.names}
    return names


def test_sub_benchmarks_import_the_shared_helpers_not_the_dispatcher():
    """common/bench.py is the command line; it imports every sub-benchmark. A sub-benchmark that imported its helpers
    back from it would import in a circle: they live in common/bench_utils.py."""
    subs = sorted(COMMON.glob("bench_*.py"))
    assert subs and COMMON.joinpath("bench_utils.py") in subs
    circular = [p.name for p in subs if "common.bench" in imported_modules(p)]
    assert not circular, f"these import common.bench, which imports them: {circular}"
    assert "common.bench" not in imported_modules(COMMON / "bench_utils.py")
