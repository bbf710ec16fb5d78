"""What every child process of the server does the same way: start, say it is ready, notice its
parent is gone."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import traceback

import zmq

POLL_TIMEOUT_MS = 500  # an idle process wakes this often to check that its parent is still there


class ChildProcess:
    """Set up at the top of a child's entry point.

    - SIGINT is ignored: Ctrl-C reaches every process of the terminal's group, and the launcher, not
      each child, decides the order of shutdown (it sends SIGTERM, which exits through SystemExit,
      so cleanups run).
    - No orphans: on Linux the kernel kills the child when its parent dies (PR_SET_PDEATHSIG, as
      SGLang does); everywhere, the child's loop checks `parent_alive()` at least every
      POLL_TIMEOUT_MS.
    """

    def __init__(self, name: str, ready_conn):
        self.name, self.ready_conn = name, ready_conn
        self.parent_pid = os.getppid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a normal exit: atexit cleanups run
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def ready(self, info=None) -> None:
        """The handshake: the launcher waits for this before it starts the next process or
        serves. It also names the processes this one started (the scheduler's tensor-parallel
        ranks), for /get_server_info."""
        started = {p.name.replace("-", " "): p.pid for p in multiprocessing.active_children()}
        self.ready_conn.send(("ready", info, started))
        self.ready_conn.close()

    def failed(self) -> None:
        """Startup failed (call it in an `except` block): send the traceback to the launcher, which
        prints it and stops the server, and exit with status 1."""
        try:
            self.ready_conn.send(("failed", traceback.format_exc()))
        except OSError:  # the launcher is gone already: say it here
            traceback.print_exc()
        sys.exit(1)


def open_sockets(bind: str, *connect: str) -> tuple[zmq.Socket, ...]:
    """A child's sockets: a PULL socket bound at `bind` (its inbox), then one PUSH socket per
    address in `connect` (the inboxes it sends to), in that order."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # at exit, drop unsent messages: a dead peer must not block it
    recv = ctx.socket(zmq.PULL)
    recv.bind(bind)
    pushes = []
    for address in connect:
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        pushes.append(push)
    return (recv, *pushes)
