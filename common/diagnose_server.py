"""The server's diagnoses for TROUBLESHOOTING.md (stage 8 on), run by `python -m common.diagnose`.

    grammar N [--schema JSON | --regex R] [--text T]
        the request's grammar alone, on the model's tokenizer: feed the expected output's tokens,
        then say whether the grammar is complete there and allows the end-of-text token, and how
        many whitespace tokens in a row it accepts where JSON allows whitespace (endless: the model
        can write whitespace until max_new_tokens)
    server N
        start the stage's server on a free port, read /get_server_info (settings, the process ids,
        the scheduler's state), show the process tree with `ps`, then send SIGTERM and time how
        long each process takes to leave; a child that ignores SIGTERM is named
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from common.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                             "age": {"type": "integer"}},
                             "required": ["name", "age"]})
ENDLESS = 200  # whitespace tokens in a row: past this, the grammar never forces the object closed
START_TIMEOUT_S, STOP_WAIT_S = 120.0, 30.0


# ---------------------------------------------------------------- the grammar alone
def cmd_grammar(args) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from common.bug_probes import sub
    from common.diagnose import stage_package

    pkg = stage_package(args.stage, args.copy)
    constrained = sub(pkg, "constrained")
    path = str(resolve_model(args.model))
    hf = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    eos = [hf.eos_token_id]
    backend = constrained.GrammarBackend(hf, vocab, eos)
    kind, text = ("regex", args.regex) if args.regex else ("json_schema", args.schema)
    try:
        compiled = backend.get_future((kind, text)).result(timeout=60)
    except ValueError as exc:
        print(f"the grammar does not compile: {exc}")
        return 1
    problems = 0

    matcher = backend.matcher(compiled)
    ids = hf.encode(args.text, add_special_tokens=False)
    for i, token in enumerate(ids):
        if not matcher.accept_token(token):
            print(f"token {i} ({hf.decode([token])!r}) of {args.text!r} is refused by the grammar")
            return 1
    eos_allowed = allowed(backend, matcher, eos[0])
    print(f"after {args.text!r} ({len(ids)} tokens): end-of-text allowed: "
          f"{'yes' if eos_allowed else 'NO'}")
    if not eos_allowed:
        print("  a complete output must let the model stop: the mask must allow end-of-text here")
        problems += 1

    if kind == "json_schema":  # where JSON allows whitespace: after '{'
        matcher = backend.matcher(compiled)
        space = hf.encode(" ", add_special_tokens=False)
        opening = hf.encode("{", add_special_tokens=False)
        if len(space) == 1 and all(matcher.accept_token(t) for t in opening):
            run = 0
            while run < ENDLESS and matcher.accept_token(space[0]):
                run += 1
            endless = run >= ENDLESS
            print(f"after '{{': {'at least ' if endless else ''}{run} spaces in a row accepted"
                  f"{': ENDLESS, a model may write whitespace until max_new_tokens' if endless else ''}")
            problems += endless
    backend.shutdown()
    print("grammar: ok" if not problems else f"grammar: {problems} problem(s)")
    return 1 if problems else 0


def allowed(backend, matcher, token: int) -> bool:
    mask = backend.allocate_mask(1)  # [1, ceil(vocab / 32)] int32
    matcher.fill_next_token_bitmask(mask, 0)
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


# ---------------------------------------------------------------- the server's processes
def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie only waits for its parent to read its status
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def start_server(pkg, model: str) -> tuple[subprocess.Popen, str, Path]:
    """`python -m <stage> --model M --port 0 --quiet` in a process group of its own (as a terminal
    starts it) -> (process, url, stderr file)."""
    folder = Path(pkg.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    err = Path(os.environ.get("TMPDIR", "/tmp")) / f"diagnose-server-{os.getpid()}.err"
    proc = subprocess.Popen([sys.executable, "-m", pkg.__name__, "--model", str(resolve_model(model)),
                             "--port", "0", "--quiet", "--max-total-tokens", "4096"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=err.open("w"),
                            text=True, start_new_session=True)
    found: list[str] = []

    def read_url():
        for line in proc.stdout:
            if line.startswith("serving "):
                found.append(line.split(" at ")[1].split()[0])
                return

    reader = threading.Thread(target=read_url, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if not found:
        proc.kill()
        raise SystemExit(f"the server did not start:\n{err.read_text()[-3000:]}")
    return proc, found[0], err


def get_json(url: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def cmd_server(args) -> int:
    from common.diagnose import stage_package

    pkg = stage_package(args.stage, args.copy)
    proc, url, err = start_server(pkg, args.model)
    try:
        info = get_json(f"{url}/get_server_info")
        pids = info.get("processes", {})
        print(f"curl {url}/get_server_info:")
        print(f"  processes: {json.dumps(pids)}")
        print(f"  internal_state (the scheduler): {json.dumps(info.get('internal_state', {}))[:300]}")
        tree = subprocess.run(["ps", "-o", "pid,ppid,stat,cmd", "--ppid", str(proc.pid)],
                              capture_output=True, text=True)
        print(f"ps -o pid,ppid,stat,cmd --ppid {proc.pid}:")
        print("\n".join("  " + line[:110] for line in tree.stdout.splitlines()))
    except BaseException:
        proc.kill()
        raise
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    gone: dict[str, float] = {}
    while len(gone) < len(pids) and time.monotonic() - start < STOP_WAIT_S:
        for name, pid in pids.items():
            if name not in gone and not alive(pid):
                gone[name] = time.monotonic() - start
        proc.poll()
        time.sleep(0.05)
    status = proc.wait(STOP_WAIT_S)
    print(f"SIGTERM -> the launcher exited with status {status}; each process left after:")
    for name, pid in pids.items():
        print(f"  {name:<22} pid {pid:<8} "
              f"{f'{gone[name]:.2f} s' if name in gone else 'STILL RUNNING'}")
    warnings = [line for line in err.read_text().splitlines() if "of SIGTERM; killing" in line]
    err.unlink(missing_ok=True)
    for line in warnings:
        print(f"  {line}")
    stuck = [name for name in pids if name not in gone]
    if status != 0 or stuck:
        print(f"shutdown: HANGS: exit status {status}, still running: {stuck or 'none'}")
        return 1
    # a child the launcher had to kill: ignores SIGTERM, or (on a loaded machine) is slow to exit
    print("shutdown: every process left; " + ("killed after the SIGTERM timeout: read the warning"
                                              if warnings else "each by itself, on SIGTERM"))
    return 0
