"""The lesson map of a chapter: which named part of the lesson each added code line belongs to.

Chapter N is the diff stage N-1 -> stage N (chapter 1: all of stage 1). Its parts are declared, in
reading order, in `common/parts/stage<N>.toml`:

    [[part]]
    id = "4.1"
    title = "The paged KV pool and its page table"
    kind = "core"          # core: the lesson; optional: speed or breadth to skip on a first reading
    claims = ["kv_cache.py", "scheduler/cache_manager.py::CacheManager", "engine.py::<module>"]

A claim is a file of the stage (every added line of it not claimed more precisely), a Python
definition in it (`path::Name`, `path::Class.method`: its lines, decorators included) or the lines
outside every definition (`path::<module>`). Each added line goes to the most precise claim covering
it, so every line has at most one owner; the same claim in two parts is refused.
"""

from __future__ import annotations

import ast
import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .stages import Stage, StageError, find_stages, resolve_stage, stage_files

CODE_SUFFIXES = (".py", ".cpp", ".c", ".h", ".cu")
PARTS_DIR = Path("common") / "parts"  # under the repository root
KINDS = {"core": 300, "optional": 600}  # the most lines a part of that kind may add
MODULE = "<module>"


@dataclass
class Part:
    id: str
    title: str
    kind: str
    claims: list[str]
    lines_added: int = 0
    symbols: dict[str, int] = field(default_factory=dict)  # "path::Qual.name" -> lines it adds

    def as_json(self) -> dict:
        return {"id": self.id, "title": self.title, "kind": self.kind, "claims": self.claims,
                "symbols": sorted(self.symbols), "files": sorted({s.split("::")[0] for s in self.symbols}),
                "lines_added": self.lines_added}


@dataclass
class Chapter:
    number: int
    old: Stage | None
    new: Stage
    parts: list[Part]
    added: dict[str, list[int]]  # code file -> line numbers (1-based, in the new stage) that the diff adds
    owner: dict[tuple[str, int], Part]  # (file, line) -> the part that claims it
    problems: list[str]

    @property
    def lines_added(self) -> int:
        return sum(len(lines) for lines in self.added.values())

    @property
    def unclaimed(self) -> list[str]:
        return [f"{path}:{n}" for path, lines in self.added.items() for n in lines if (path, n) not in self.owner]

    def as_json(self) -> dict:
        return {"chapter": self.number, "from": self.old.name if self.old else None, "to": self.new.name,
                "lines_added": self.lines_added, "parts": [p.as_json() for p in self.parts],
                "unclaimed": len(self.unclaimed), "unclaimed_lines": self.unclaimed[:50],
                "problems": self.problems}


def code_lines(path: Path | None) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path and path.is_file() else []


def added_line_numbers(old: list[str], new: list[str]) -> list[int]:
    """1-based numbers of the lines of `new` that a line diff from `old` marks as added."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    return [j + 1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert")
            for j in range(j1, j2)]


def symbol_of_lines(source: str) -> dict[int, str]:
    """Line number -> qualified name of the innermost def/class holding it ("" outside all)."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                for n in range(start, (child.end_lineno or child.lineno) + 1):
                    owner[n] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return owner


def chapter_files(old: Stage | None, new: Stage) -> dict[str, list[int]]:
    """Code files of `new` with the lines the chapter adds (files without added lines left out)."""
    added: dict[str, list[int]] = {}
    for rel in stage_files(new.path):
        if rel.endswith(CODE_SUFFIXES):
            lines = added_line_numbers(code_lines(old.path / rel if old else None), code_lines(new.path / rel))
            if lines:
                added[rel] = lines
    return added


def read_parts(root: Path, number: int) -> list[Part]:
    path = root / PARTS_DIR / f"stage{number}.toml"
    if not path.is_file():
        raise StageError(f"chapter {number} has no lesson map: {path} is missing")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise StageError(f"{path}: {err}") from None
    parts = []
    for i, entry in enumerate(table.get("part", []), 1):
        missing = [key for key in ("id", "title", "kind", "claims") if key not in entry]
        if missing:
            raise StageError(f"{path}: part {i} lacks {', '.join(missing)}")
        parts.append(Part(str(entry["id"]), entry["title"], entry["kind"], list(entry["claims"])))
    return parts


def split_claim(claim: str) -> tuple[str, str | None]:
    path, _, symbol = claim.partition("::")
    return path, (symbol or None)


def claim_covers(path: str, symbol: str | None, rel: str, qualname: str) -> int:
    """How precisely a claim covers line `qualname` of file `rel`: 0 not at all, higher wins
    (a folder, then a file, then the lines outside definitions or a definition, inner ones last)."""
    if path != rel:
        return 1 if rel.startswith(path.rstrip("/") + "/") and symbol is None else 0
    if symbol is None:
        return 2
    if symbol == MODULE:
        return 3 if qualname == "" else 0
    if qualname == symbol or qualname.startswith(symbol + "."):
        return 4 + symbol.count(".")
    return 0


def map_chapter(root: Path, number: int) -> Chapter:
    stages = find_stages(root)
    new = resolve_stage(stages, str(number))
    old = ([s for s in stages if s.number < number] or [None])[-1]
    parts, added = read_parts(root, number), chapter_files(old, new)
    problems = check_declaration(number, parts)
    symbols = {rel: symbol_of_lines((new.path / rel).read_text(encoding="utf-8")) if rel.endswith(".py") else {}
               for rel in added}
    claims: list[tuple[str, str | None, Part]] = []
    for part in parts:
        for claim in part.claims:
            path, symbol = split_claim(claim)
            if not claim_exists(new.path / path, symbol):
                problems.append(f"part {part.id}: claim {claim!r} names no file, folder or definition of {new.name}")
            claims.append((path, symbol, part))
    owner: dict[tuple[str, int], Part] = {}
    for rel, lines in added.items():
        mine = [(path, symbol, part) for path, symbol, part in claims if rel == path or rel.startswith(path + "/")]
        for n in lines:
            qualname = symbols[rel].get(n, "")
            scored = [(claim_covers(path, symbol, rel, qualname), part) for path, symbol, part in mine]
            best = max((score for score, _ in scored), default=0)
            if best:
                part = next(part for score, part in scored if score == best)
                owner[(rel, n)] = part
                part.lines_added += 1
                key = f"{rel}::{qualname}" if qualname else rel
                part.symbols[key] = part.symbols.get(key, 0) + 1
    for part in parts:
        limit = KINDS.get(part.kind)
        if limit is not None and part.lines_added > limit:
            problems.append(f"part {part.id} ({part.kind}) adds {part.lines_added} lines, over {limit}: split it")
    return Chapter(number, old, new, parts, added, owner, problems)


def claim_exists(path: Path, symbol: str | None) -> bool:
    if symbol is None:
        return path.exists()
    if not (path.is_file() and path.suffix == ".py"):
        return False
    return symbol == MODULE or symbol in set(symbol_of_lines(path.read_text(encoding="utf-8")).values())


def check_declaration(number: int, parts: list[Part]) -> list[str]:
    """Ids N.1, N.2, ... in order, known kinds, each claim in one part only."""
    problems = []
    for k, part in enumerate(parts, 1):
        if part.id != f"{number}.{k}":
            problems.append(f"part {part.id}: expected id {number}.{k} (ids count up in reading order)")
        if part.kind not in KINDS:
            problems.append(f"part {part.id}: kind {part.kind!r} is not one of {', '.join(KINDS)}")
    seen: dict[str, str] = {}
    for part in parts:
        for claim in part.claims:
            if claim in seen:
                problems.append(f"claim {claim!r} is in parts {seen[claim]} and {part.id}")
            seen.setdefault(claim, part.id)
    if not parts:
        problems.append(f"chapter {number} declares no parts")
    return problems


def format_chapter(chapter: Chapter) -> str:
    old = chapter.old.name if chapter.old else "(nothing)"
    lines = [f"chapter {chapter.number}: {old} -> {chapter.new.name}, {chapter.lines_added} code lines added, "
             f"{len(chapter.parts)} parts, unclaimed {len(chapter.unclaimed)}"]
    for part in chapter.parts:
        lines.append(f"  {part.id:<5} {part.kind:<8} {part.lines_added:>5}  {part.title}")
        for symbol, count in part.symbols.items():
            lines.append(f"{'':>23}{count:>5}  {symbol}")
    lines += [f"  unclaimed: {where}" for where in chapter.unclaimed[:20]]
    lines += [f"  problem: {problem}" for problem in chapter.problems]
    return "\n".join(lines)


CONTEXT = 2  # unchanged lines shown around each change of a part


def change_owners(chapter: Chapter, rel: str, old_symbols: dict[int, str], change: tuple) -> set[str | None]:
    """The parts that own one change of a file: its added lines' owners, or for a removal the
    part whose claim covers the removed lines' definition."""
    tag, i1, i2, j1, j2 = change
    if tag != "delete":
        return {getattr(chapter.owner.get((rel, j + 1)), "id", None) for j in range(j1, j2)}
    claims = [(*split_claim(c), p.id) for p in chapter.parts for c in p.claims]
    owners = set()
    for qualname in {old_symbols.get(i + 1, "") for i in range(i1, i2)}:
        best = max(((claim_covers(path, symbol, rel, qualname), pid) for path, symbol, pid in claims),
                   default=(0, None))
        owners.add(best[1] if best[0] else None)
    return owners


def part_hunks(old: list[str], new: list[str], rel: str, chapter: Chapter, wanted: set[str]) -> list[str]:
    """One hunk per change owned by a wanted part, with a little context."""
    old_symbols = symbol_of_lines("\n".join(old)) if rel.endswith(".py") and old else {}
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    out: list[str] = []
    for change in (c for c in matcher.get_opcodes() if c[0] != "equal"):
        if not change_owners(chapter, rel, old_symbols, change) & wanted:
            continue
        _, i1, i2, j1, j2 = change
        before, after = min(CONTEXT, i1), min(CONTEXT, len(old) - i2)
        out.append(f"@@ -{i1 - before + 1},{i2 - i1 + before + after} +{j1 - before + 1},"
                   f"{j2 - j1 + before + after} @@")
        out += [f" {line}" for line in old[i1 - before:i1]] + [f"-{line}" for line in old[i1:i2]]
        out += [f"+{line}" for line in new[j1:j2]] + [f" {line}" for line in old[i2:i2 + after]]
    return out


def part_diff(root: Path, number: int, wanted: set[str]) -> list[str]:
    """The diff of chapter `number` restricted to the parts whose ids are in `wanted`."""
    chapter = map_chapter(root, number)
    unknown = wanted - {p.id for p in chapter.parts}
    if unknown:
        raise StageError(f"chapter {number} has no part {', '.join(sorted(unknown))} "
                         f"(parts: {', '.join(p.id for p in chapter.parts)})")
    out: list[str] = []
    for rel in sorted(chapter.added.keys() | removal_only_files(chapter)):
        old_path = chapter.old.path / rel if chapter.old else None
        hunks = part_hunks(code_lines(old_path), code_lines(chapter.new.path / rel), rel, chapter, wanted)
        if hunks:
            name_a = f"a/{chapter.old.name}/{rel}" if old_path and old_path.is_file() else "/dev/null"
            out += [f"--- {name_a}", f"+++ b/{chapter.new.name}/{rel}", *hunks]
    return out


def removal_only_files(chapter: Chapter) -> set[str]:
    """Code files both stages have whose diff only removes lines (no added line to own them)."""
    if not chapter.old:
        return set()
    files = set()
    for rel in stage_files(chapter.new.path):
        old = chapter.old.path / rel
        if rel.endswith(CODE_SUFFIXES) and rel not in chapter.added and old.is_file():
            if old.read_bytes() != (chapter.new.path / rel).read_bytes():
                files.add(rel)
    return files


STAGE_NAME_RE = re.compile(r"stage\d+_\w+|\b[Ss]tage \d+")


def name_only_differences(old: Stage, new: Stage) -> list[str]:
    """Files of both stages that differ only where they name a stage: a diff with no lesson in it."""
    found = []
    for rel in stage_files(new.path):
        a, b = old.path / rel, new.path / rel
        if rel.endswith(CODE_SUFFIXES) and a.is_file() and a.read_bytes() != b.read_bytes():
            if STAGE_NAME_RE.sub("", a.read_text()) == STAGE_NAME_RE.sub("", b.read_text()):
                found.append(rel)
    return found
