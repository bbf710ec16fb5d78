"""A learner's copy of a stage, and the source surgery behind it: stub a function, restore it.

Functions are found by name in the parsed source (`ast`), never by line number, so a reformatted
engine file stubs the same way. A stubbed function keeps its decorators, signature and docstring;
the rest of its body becomes one `raise NotImplementedError("exercise N.name: ...")` carrying the
hint. The engine's own files carry no exercise markers: the catalogue (common/exercise_tasks.py)
says what to stub.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import textwrap
from pathlib import Path

from common.exercise_tasks import BY_ID, Task

STUB_PREFIX = "exercise "  # every stub's message starts "exercise N.name:"
WIDTH = 100  # the course's line length
COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.ipynb", "figures", "README.md")


class SourceError(ValueError):
    """A symbol is not where the catalogue says, or a file does not parse."""


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The def of `function` or `Class.method` (nested classes: `A.B.method`) at module level."""
    body, node = tree.body, None
    for part in qualname.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            raise SourceError(f"no {qualname!r} here ({part!r} not found)")
        body = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SourceError(f"{qualname!r} is a class, not a function")
    return node


def parse(source: str, where: str = "<source>") -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as e:
        raise SourceError(f"{where}:{e.lineno}: does not parse ({e.msg})") from None


def _docstring_end(node) -> int | None:
    first = node.body[0]
    value = getattr(first, "value", None)
    is_doc = isinstance(first, ast.Expr) and isinstance(value, ast.Constant)
    return first.end_lineno if is_doc and isinstance(value.value, str) else None


def body_lines(lines: list[str], node) -> tuple[int, int]:
    """1-based (first, last) lines of the body after the docstring, comments opening it included."""
    doc_end = _docstring_end(node)
    if doc_end is not None:
        if len(node.body) == 1:
            return doc_end + 1, doc_end  # docstring only: nothing to remove
        return doc_end + 1, node.end_lineno
    first = node.body[0].lineno
    if first == node.lineno:
        raise SourceError(f"{node.name}: a one-line def cannot be stubbed")
    while first - 1 > node.lineno and _opens_body(lines[first - 2]):
        first -= 1  # comment lines between the signature and the first statement go with the body
    return first, node.end_lineno


def _opens_body(line: str) -> bool:
    return not line.strip() or line.strip().startswith("#")


def def_lines(node) -> tuple[int, int]:
    """1-based (first, last) lines of the whole definition, decorators included."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return start, node.end_lineno


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def raise_lines(indent: str, message: str) -> list[str]:
    """`raise NotImplementedError(`, the message as string literals within WIDTH columns, `)`."""
    inner = indent + "    "
    chunks = textwrap.wrap(message, WIDTH - len(inner) - 3, break_long_words=True,
                           break_on_hyphens=False)
    literals = [_literal(c + (" " if i < len(chunks) - 1 else "")) for i, c in enumerate(chunks)]
    body = [f"{inner}{lit}\n" for lit in literals]
    return [f"{indent}raise NotImplementedError(\n", *body, f"{indent})\n"]


def stub_source(source: str, messages: dict[str, str], where: str = "<source>") -> str:
    """`source` with each function of `messages` (qualname -> hint) stubbed."""
    tree = parse(source, where)
    lines = source.splitlines(keepends=True)
    edits = []
    for qualname, message in messages.items():
        node = find_def(tree, qualname)
        first, last = body_lines(lines, node)
        body = node.body[1] if _docstring_end(node) is not None else node.body[0]
        indent = lines[body.lineno - 1][: body.col_offset]
        edits.append((first, last, raise_lines(indent, message)))
    for first, last, new in sorted(edits, reverse=True):  # bottom up: line numbers stay valid
        lines[first - 1 : last] = new
    out = "".join(lines)
    parse(out, where)  # a stub must never break the file
    return out


def def_source(source: str, qualname: str, where: str = "<source>") -> str:
    """The text of one definition, decorators included, as it stands in `source`."""
    node = find_def(parse(source, where), qualname)
    first, last = def_lines(node)
    return "".join(source.splitlines(keepends=True)[first - 1 : last])


def replace_defs(source: str, reference: str, qualnames: list[str], where: str = "<source>") -> str:
    """`source` with the definitions named replaced by their text in `reference` (a reset)."""
    tree, ref_tree = parse(source, where), parse(reference, "reference")
    lines, ref_lines = source.splitlines(keepends=True), reference.splitlines(keepends=True)
    edits = []
    for qualname in qualnames:
        first, last = def_lines(find_def(tree, qualname))
        ref_first, ref_last = def_lines(find_def(ref_tree, qualname))
        edits.append((first, last, ref_lines[ref_first - 1 : ref_last]))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1 : last] = new
    out = "".join(lines)
    parse(out, where)
    return out


def is_stub(source: str, qualname: str) -> bool:
    """The function's body is still a stub: `raise NotImplementedError("exercise ...")`."""
    node = find_def(parse(source), qualname)
    body = node.body[1:] if _docstring_end(node) is not None else node.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return False
    if not isinstance(body[0].exc, ast.Call):
        return False
    args = body[0].exc.args
    return (getattr(body[0].exc.func, "id", None) == "NotImplementedError" and len(args) == 1
            and isinstance(args[0], ast.Constant) and str(args[0].value).startswith(STUB_PREFIX))


def digest(source: str, qualnames: list[str]) -> str:
    """A fingerprint of the named definitions: tells whether they changed since the last check."""
    h = hashlib.sha256()
    for qualname in qualnames:
        try:
            h.update(def_source(source, qualname).encode())
        except SourceError as e:
            h.update(str(e).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- a stage's copy
def stub_message(t: Task, stage_name: str, qualname: str) -> str:
    return (f"{STUB_PREFIX}{t.id}: {t.symbols[qualname]} Why: {stage_name}/README.md, section "
            f"'{t.readme}'. Check: python -m common.exercises check {t.stage} {t.id}")


def stub_tasks(pkg: Path, tasks: list[Task], stage_name: str | None = None) -> None:
    """Stub the tasks' functions in the stage package at `pkg` (a copy, never the course's)."""
    by_file: dict[str, dict[str, str]] = {}
    for t in tasks:
        messages = {q: stub_message(t, stage_name or pkg.name, q) for q in t.symbols}
        by_file.setdefault(t.file, {}).update(messages)
    for file, messages in by_file.items():
        path = pkg / file
        path.write_text(stub_source(path.read_text(encoding="utf-8"), messages, str(path)),
                        encoding="utf-8")


def make_copy(reference: Path, dst: Path, tasks: list[Task]) -> None:
    """The stage package's code at dst (notebook, figures, README and caches stay in the course),
    with the tasks' functions stubbed."""
    shutil.copytree(reference, dst, ignore=COPY_IGNORE)
    stub_tasks(dst, tasks, reference.name)


class Workspace:
    """<base>/<stage>/: the learner's copy of the stage package, and exercise.json (the tasks
    started, the last check's results)."""

    STATE = "exercise.json"

    def __init__(self, base: Path, reference: Path):
        self.reference_pkg, self.dir = reference, base / reference.name
        self.pkg = self.dir / reference.name

    @property
    def exists(self) -> bool:
        return (self.dir / self.STATE).is_file()

    def state(self) -> dict:
        if not self.exists:
            return {"started": [], "results": {}}
        return json.loads((self.dir / self.STATE).read_text())

    def save(self, state: dict) -> None:
        (self.dir / self.STATE).write_text(json.dumps(state, indent=1))

    def source(self, t: Task) -> str:
        return (self.pkg / t.file).read_text(encoding="utf-8")

    def reference(self, t: Task) -> str:
        return (self.reference_pkg / t.file).read_text(encoding="utf-8")

    def status(self, t: Task, state: dict) -> str:
        if not self.exists or t.id not in state["started"]:
            return "not started"
        source = self.source(t)
        try:
            parse(source, t.file)
            if any(is_stub(source, q) for q in t.symbols):
                return "todo"
        except SourceError as e:
            return str(e)
        last = state["results"].get(t.id)
        if last is None or last["digest"] != digest(source, list(t.symbols)):
            return "written, not checked"
        return "pass" if last["passed"] else "fail"

    def stale_files(self, state: dict) -> list[str]:
        """Files of no started task that differ from the course's stage (changed since `start`)."""
        mine = {BY_ID[i].file for i in state["started"]}
        stale = []
        for path in sorted(self.reference_pkg.rglob("*.py")):
            rel = str(path.relative_to(self.reference_pkg))
            copy = self.pkg / rel
            if "__pycache__" in path.parts or rel in mine:
                continue
            if not copy.is_file() or copy.read_bytes() != path.read_bytes():
                stale.append(rel)
        return stale
