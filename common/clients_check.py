"""Real clients against stage 8's server: does the software people actually use talk to it?

    python -m common.clients_check [--model smollm2-135m-instruct] [--only openai,lm-eval]
                                   [--stage stage9_moe] [--json rows.json]

It starts the server itself (`python -m stage8_server` on 127.0.0.1, a free port), runs every check
below against it, stops it at the end (always: also on an error or Ctrl-C), and prints one table
row per check: client, what was run, PASS / FAIL / SKIP, seconds, notes. It exits 1 if any row is
FAIL. A tool that is not installed gives SKIP naming what to install, never a pass.

    openai      the official SDK: chat (streamed and not), completions, n=2, logprobs, and
                structured outputs (response_format json_schema / json_object, the SDK's
                `parse`, tool_choice naming a function)
    langchain   langchain-openai's ChatOpenAI: invoke, stream, with_structured_output (pydantic
                model) with method="json_schema" and method="function_calling"
    litellm     litellm.completion(model="openai/<name>", api_base=...), streamed and not
    guidellm    `guidellm run`: a synchronous benchmark of 8 requests (64 prompt, 32 output tokens)
    aiperf      `aiperf profile`: 4 streamed chat requests, one at a time
    lm-eval     `lm-eval run --model local-completions` on a 20-question multiple-choice task
                written to a temporary folder, against lm-eval's own `hf` backend on the same
                model: per-choice loglikelihoods within 1e-3, accuracy equal

The tools are large (and pull in torch-dependent packages), so they live in the `clients` extra,
installed into a virtual environment of its own; a constraints file keeps pip from replacing the
CPU build of torch with a CUDA one:

    python -m venv ~/venvs/clients --system-site-packages
    echo "torch==2.13.0" > /tmp/torch-constraint.txt
    PIP_CONSTRAINT=/tmp/torch-constraint.txt ~/venvs/clients/bin/pip install -e ".[clients]"
    ~/venvs/clients/bin/python -m common.clients_check

Everything runs offline: the model and its tokenizer come from common/models.py (a local Hugging
Face folder, given to the tools that count tokens), the lm-eval data set is written locally, and
the Hub is switched off (HF_HUB_OFFLINE=1) for every tool but aiperf (see clients_tools.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1",
    "LANGSMITH_TRACING": "false",
}
INSTALL_HINT = 'pip install -e ".[clients]"'


class Skip(Exception):
    """The check cannot run here (a tool is missing): a SKIP row with this reason."""


@dataclass
class Row:
    client: str
    what: str
    result: str = "SKIP"  # PASS / FAIL / SKIP
    seconds: float = 0.0
    notes: str = ""


@dataclass
class Context:
    """What every check gets: the live server and the model it serves."""

    url: str  # http://127.0.0.1:PORT
    model: str  # the served model name
    model_path: Path  # the local Hugging Face folder (tokenizer for the tools that count tokens)
    workdir: Path  # a temporary folder for the tools' outputs, removed at the end
    memo: dict = field(default_factory=dict)  # results one check shares with a later one


# ---------------------------------------------------------------- the registry of checks
CHECKS: list[tuple[str, str, Callable[[Context], str]]] = []


def check(client: str, what: str):
    """Register fn(ctx) -> notes as one row; it raises AssertionError (FAIL) or Skip (SKIP)."""

    def register(fn):
        CHECKS.append((client, what, fn))
        return fn

    return register


def need(module: str, package: str | None = None) -> None:
    """Skip unless `module` can be imported (the tools of the `clients` extra)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise Skip(f"{package or module} is not installed ({INSTALL_HINT})")


def describe(exc: BaseException) -> str:
    """A FAIL's reason in one line: an HTTP error as its status and the server's message."""
    status = getattr(exc, "status_code", None)
    if status is not None:
        body = getattr(exc, "body", None)
        message = body.get("message") if isinstance(body, dict) else None
        return f"HTTP {status}: {message or exc}"
    if isinstance(exc, AssertionError):
        return str(exc) or "assertion failed"
    return f"{type(exc).__name__}: {exc}"


def run_checks(ctx: Context, clients: list[str] | None = None, echo: bool = True) -> list[Row]:
    rows = []
    for client, what, fn in CHECKS:
        if clients is not None and client not in clients:
            continue
        row, start = Row(client, what), time.perf_counter()
        try:
            row.notes, row.result = fn(ctx), "PASS"
        except Skip as exc:
            row.notes = str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a FAIL row, with its reason
            row.result, row.notes = "FAIL", describe(exc)
        row.seconds = time.perf_counter() - start
        row.notes = " ".join(row.notes.split())  # one line in the table
        rows.append(row)
        if echo:
            print(
                f"  {row.result:4}  {row.client:9}  {row.what}  ({row.seconds:.1f} s)", flush=True
            )
    return rows


# ---------------------------------------------------------------- the server
@contextmanager
def running_server(
    model_path: Path,
    served_name: str,
    stage: str = "stage8_server",
    extra_args: tuple[str, ...] = (),
):
    """`python -m <stage> --port 0` in its own process group; yields its URL; SIGTERM (then
    SIGKILL) to the whole group on the way out, whatever happened."""
    log = tempfile.NamedTemporaryFile(
        "w+", prefix="clients-check-server-", suffix=".log", delete=False
    )
    cmd = [
        sys.executable,
        "-m",
        stage,
        "--model",
        str(model_path),
        "--port",
        "0",
        "--quiet",
        "--served-model-name",
        served_name,
        *extra_args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    found: list[str] = []

    def read_url():  # the server prints "serving NAME at URL ..." once it listens
        for line in proc.stdout:
            if line.startswith("serving ") and " at " in line:
                found.append(line.split(" at ")[1].split()[0])
                break
        for _ in proc.stdout:  # keep draining, so the server never blocks on a full pipe
            pass

    threading.Thread(target=read_url, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not found:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(
                    f"the server did not start ({' '.join(cmd)}):\n"
                    f"{Path(log.name).read_text()[-3000:]}"
                )
            time.sleep(0.2)
        yield found[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        os.unlink(log.name)


# ---------------------------------------------------------------- the table
def versions() -> str:
    names = (
        "openai",
        "langchain-openai",
        "litellm",
        "guidellm",
        "aiperf",
        "lm_eval",
        "torch",
        "transformers",
    )
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load}, "
            f"Python {platform.python_version()}")


def format_table(rows: list[Row]) -> str:
    header = ("client", "what was run", "result", "seconds", "notes")
    lines = [f"| {' | '.join(header)} |", "|---|---|---|---:|---|"]
    for r in rows:
        notes = r.notes.replace("|", "\\|")
        lines.append(f"| {r.client} | {r.what} | {r.result} | {r.seconds:.1f} | {notes} |")
    return "\n".join(lines)


def known_clients() -> list[str]:
    return list(dict.fromkeys(client for client, _, _ in CHECKS))


def stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # the `finally` blocks then stop the server and the tools


def main(argv: list[str] | None = None) -> int:
    from . import (
        clients_lm_eval,
        clients_openai,
        clients_tools,
    )  # noqa: F401 - they register checks
    from .models import SMOLLM2, resolve_model

    known = known_clients()
    parser = argparse.ArgumentParser(
        prog="python -m common.clients_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default=SMOLLM2, help="short name (common/models.py) or local HF folder"
    )
    parser.add_argument(
        "--stage", default="stage8_server", help="the stage package whose server runs"
    )
    parser.add_argument(
        "--only", default=None, help=f"comma-separated clients, from: {','.join(known)}"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    clients = None if args.only is None else [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(clients or ()) - set(known))
    if unknown:
        parser.error(f"unknown client(s) {unknown}; known: {known}")

    model_path = resolve_model(args.model)
    served = model_path.name if Path(args.model).exists() else args.model
    print(
        f"clients_check {time.strftime('%Y-%m-%d %H:%M')}: {args.stage} serving {served} "
        f"({model_path})\n{machine()}\n{versions()}",
        flush=True,
    )
    saved_env, saved_handler = dict(os.environ), signal.signal(signal.SIGTERM, stop_on_sigterm)
    os.environ.update(OFFLINE_ENV)
    try:
        with tempfile.TemporaryDirectory(prefix="clients-check-") as tmp:
            with running_server(model_path, served, args.stage) as url:
                print(f"server at {url}", flush=True)
                rows = run_checks(Context(url, served, model_path, Path(tmp)), clients)
    finally:  # SIGTERM ends the run as Ctrl-C does; the caller's environment comes back
        signal.signal(signal.SIGTERM, saved_handler)
        os.environ.clear()
        os.environ.update(saved_env)
    print()
    print(format_table(rows))
    counts = {k: sum(r.result == k for r in rows) for k in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    # The check modules register into `common.clients_check`, not into this `__main__` copy of it.
    from common.clients_check import main as registered_main

    sys.exit(registered_main())
