"""Start the server's processes, serve, and stop them all together.

    main process: API server (FastAPI + uvicorn) ─▶ tokenizer worker ─▶ scheduler
                  ─▶ detokenizer worker ─▶ back to the API server

1. Bind the HTTP port first (a port in use fails in a second, not after the model loaded).
2. Start the scheduler (multiprocessing "spawn": a fresh interpreter, no state copied from this one)
   and wait for its handshake: it sends ("ready", EngineInfo) once the model is loaded, or
   ("failed", traceback). Then the tokenizer and detokenizer workers (the tokenizer validates
   against the engine's context length and vocabulary). Each has STARTUP_TIMEOUT_S to say it is
   ready.
3. Serve. A watchdog thread waits on every child's sentinel: when one dies, it names it, fails every
   request in flight (503) and stops uvicorn. SIGINT and SIGTERM stop uvicorn in order
   (api_server.APIServer): it stops accepting, every live request is ended (a stream: an error event
   and [DONE]), the open connections finish, then the API server's sockets close.
4. On the way out, whatever the reason (SIGINT, SIGTERM, a dead child, a failed start), SIGTERM
   every child that is still alive, wait, SIGKILL the stubborn ones. A dead child makes the exit
   status 1. Children also watch their parent (process.py), so even a SIGKILLed launcher leaves no
   orphans.

A SIGKILLed launcher cannot remove its ipc folder (/tmp/sglz-*), so each start removes those whose
launcher is gone. Gone is proved, not guessed from a process id (which may be reused, or belong to
another PID namespace sharing /tmp): a launcher holds an flock on its folder's owner.lock for its
whole life, and the kernel releases it when the process ends, however it ends.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..server_args import ServerArgs, comma_list
from .access import AccessPolicy, RequestLimits, max_token_bytes, prompt_bytes_limit
from .detokenizer_worker import run_detokenizer_worker
from .messages import PortArgs
from .scheduler_process import run_scheduler
from .tokenizer_worker import run_tokenizer_worker

STARTUP_TIMEOUT_S = 600.0  # the first start of a model may convert its weights
STOP_TIMEOUT_S = 5.0  # per child, after SIGTERM, before SIGKILL
IPC_PREFIX, OWNER_LOCK = "sglz-", "owner.lock"
API_KEY_ENV = "SGLANG_API_KEY"  # --api-key's default


class LaunchError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: mp.Process
    ready_conn: object
    started: dict[str, int] = field(default_factory=dict)  # the processes it started: name -> pid


@dataclass
class Launcher:
    ports: PortArgs = field(default_factory=PortArgs.new)
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    died: str | None = None  # which child died, and how
    lock_fd: int | None = None

    def __post_init__(self) -> None:
        self.lock_fd = hold_ipc_folder(self.ipc_folder)

    @property
    def ipc_folder(self) -> Path:
        return Path(self.ports.api_ipc_name.removeprefix("ipc://")).parent

    def start(self, name: str, target, *args) -> Child:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=target, args=(*args, self.ports, writer), name=name,
                              daemon=False)
        process.start()
        writer.close()  # the child holds its own copy; EOF on `reader` now means the child is gone
        child = Child(name, process, reader)
        self.children.append(child)
        return child

    def wait_ready(self, child: Child, timeout: float = STARTUP_TIMEOUT_S):
        """The handshake: what the child sent with "ready", or LaunchError naming it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.ready_conn.poll(0.2):
                try:
                    status, payload, *started = child.ready_conn.recv()
                except EOFError:
                    break
                if status == "ready":
                    child.started = started[0] if started else {}
                    return payload
                raise LaunchError(f"the {child.name} failed to start:\n{payload}")
            if not child.process.is_alive():
                break
        child.process.join(0.5)
        if child.process.exitcode is not None:
            raise LaunchError(
                f"the {child.name} exited during startup (exit code {child.process.exitcode})")
        raise LaunchError(f"the {child.name} did not get ready within {timeout:.0f} s")

    def watch(self, on_death) -> threading.Thread:
        """A thread that calls on_death(message) when any child dies while serving."""

        def run():
            sentinels = {c.process.sentinel: c for c in self.children}
            ready = mp.connection.wait(list(sentinels))
            if self.stopping:
                return
            child = sentinels[ready[0]]
            child.process.join(1.0)
            self.died = (
                f"the {child.name} (pid {child.process.pid}) died with exit code "
                f"{child.process.exitcode}"
            )
            print(f"error: {self.died}; stopping the server", file=sys.stderr, flush=True)
            on_death(self.died)

        thread = threading.Thread(target=run, name="watchdog", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """SIGTERM every live child, wait, SIGKILL what is left; remove the ipc folder."""
        self.stopping = True
        for child in self.children:
            if child.process.is_alive():
                child.process.terminate()
        for child in self.children:
            child.process.join(STOP_TIMEOUT_S)
            if child.process.is_alive():
                print(f"warning: the {child.name} did not exit within {STOP_TIMEOUT_S:g} s of "
                      "SIGTERM; killing it", file=sys.stderr)
                child.process.kill()
                child.process.join()
        shutil.rmtree(self.ipc_folder, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def processes(self) -> dict[str, int]:
        """name -> pid of every process of the server, the children's own children included."""
        pids = {"api_server": os.getpid()}
        for child in self.children:
            pids[child.name] = child.process.pid
            pids.update(child.started)
        return pids


def hold_ipc_folder(folder: Path) -> int:
    """Lock the folder's owner.lock for as long as this process lives (the returned descriptor
    holds it). The lock file is locked under another name, then renamed: a cleaner never sees an
    unlocked owner.lock of a live server."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".lock-")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(tmp, folder / OWNER_LOCK)
    return fd


def remove_stale_ipc_folders(base: str | Path | None = None) -> list[Path]:
    """Remove the ipc folders of launchers that are gone: this user's sglz-* folders whose
    owner.lock nobody holds. A folder with no owner.lock (from an older version, or a launcher in
    its first microseconds) is left alone: nothing proves it stale."""
    removed = []
    for folder in sorted(Path(base or tempfile.gettempdir()).glob(IPC_PREFIX + "*")):
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            fd = os.open(folder / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its launcher is alive
        finally:
            os.close(fd)  # after a successful flock, closing releases it: the folder goes anyway
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def bind_port(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


def launch_server(server_args: ServerArgs, verbose: bool = True) -> int:
    """Run the server until SIGINT / SIGTERM or a child's death. Returns the exit status (0: asked
    to stop). server_args.model_path: a resolved folder (every process loads the same one)."""
    import uvicorn  # the server's dependencies, imported only by the process that serves

    from .api_server import APIServer, create_app

    # SystemExit: the `finally` below stops the children
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    remove_stale_ipc_folders()
    launcher = Launcher()
    host = server_args.host
    try:
        sock = bind_port(host, server_args.port)
        port = sock.getsockname()[1]  # port 0: the system picked one
        scheduler = launcher.start("scheduler", run_scheduler, server_args, verbose)
        info = launcher.wait_ready(scheduler)
        model_path = server_args.model_path
        tokenizer = launcher.start("tokenizer worker", run_tokenizer_worker, model_path, info)
        detokenizer = launcher.start("detokenizer worker", run_detokenizer_worker, model_path)
        launcher.wait_ready(tokenizer)
        launcher.wait_ready(detokenizer)

        name = server_args.served_model_name or model_path
        api_key = server_args.api_key or os.environ.get(API_KEY_ENV) or None
        server_info = {
            "model_path": model_path, "server_args": {
                f.name: "<set>" if f.name == "api_key" and api_key else str(
                    getattr(server_args, f.name)) for f in fields(server_args)
            }, "processes": launcher.processes()
        }
        access = AccessPolicy.for_server(host, comma_list(server_args.allowed_hosts),
                                         comma_list(server_args.allowed_origins), api_key,
                                         server_args.max_request_body_bytes)
        token_bytes = max_token_bytes(model_path)
        limits = RequestLimits(server_args.max_requests_per_call, prompt_bytes_limit(
            min(info.max_context_len, info.max_total_tokens), token_bytes), token_bytes)
        app = create_app(launcher.ports, name, info, server_info, access, limits)
        server = APIServer(
            uvicorn.Config(app, log_level=server_args.log_level, timeout_graceful_shutdown=2))

        def on_death(message: str) -> None:
            loop = getattr(app.state, "loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(app.state.client.fail_all, message)
            server.should_exit = True

        launcher.watch(on_death)
        url = f"http://{host}:{port}"
        key_header = f'-H "Authorization: Bearer ${API_KEY_ENV}" ' if api_key else ""
        print(f"serving {name} at {url} (playground: {url}/)\n"
              f"  curl {url}/v1/chat/completions {key_header}"
              "-H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", "
              f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)
        server.run(sockets=[sock])
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        launcher.stop()
    return 1 if launcher.died else 0
