"""The API server's end of the sockets: send requests to the tokenizer worker, route every output
back to the HTTP handler waiting for it (the part of SGLang's TokenizerManager that talks to the
engine).

One background task reads the API server's inbox (text outputs from the detokenizer, refusals from
the tokenizer worker, control replies from the scheduler) and puts each output on the queue of the
request it belongs to. An HTTP handler never touches a socket's receiving end: it awaits its own
queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import zmq
import zmq.asyncio

from .messages import (
    AbortReq,
    BatchStrOut,
    ControlOut,
    ControlReq,
    GenerateReqInput,
    PortArgs,
    ReqOutput,
)
from .protocol import APIError

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still connected
CONTROL_TIMEOUT_S = 30.0


class Disconnected(Exception):
    """The HTTP client went away; its requests were aborted."""


class RequestHandle:
    """The requests of one HTTP call (n copies of each of its prompts) and the queue their outputs
    arrive on."""

    def __init__(self, client: "EngineClient"):
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[int, int] = {}  # rid -> choice index
        self.unfinished: set[int] = set()

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def next(self) -> tuple[int, ReqOutput]:
        """(choice index, output). A refused request raises APIError (400), after the others were
        aborted."""
        out = await self.queue.get()
        if isinstance(out, BaseException):
            raise out
        if out.finished:
            self.unfinished.discard(out.rid)
        if out.finish_reason == "error":
            await self.abort()
            # a request failing inside the engine is a 500; a refused request a 400
            status = {"engine_dead": 503, "internal_error": 500}.get(out.error_code, 400)
            raise APIError(status, out.error or "request failed", None, out.error_code)
        return self.index[out.rid], out

    async def abort(self) -> None:
        """Stop every unfinished request of this call (its KV pages are freed in the scheduler)."""
        rids, self.unfinished = sorted(self.unfinished), set()
        await self.client.abort(rids)

    async def abort_on_disconnect(self, request) -> None:
        """Runs beside the handler: when the client disconnects, abort and wake the handler up."""
        while not self.done:
            if await request.is_disconnected():
                await self.abort()
                self.queue.put_nowait(Disconnected())
                return
            await asyncio.sleep(DISCONNECT_POLL_S)


class EngineClient:
    def __init__(self, ports: PortArgs):
        self.ctx = zmq.asyncio.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.to_tokenizer = self.ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(ports.tokenizer_ipc_name)
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ports.api_ipc_name)
        # rid -> the handle of the HTTP call it belongs to
        self.handles: dict[int, RequestHandle] = {}
        self.controls: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()  # rids and control ids: unique for the server's life
        self.dead: str | None = None  # why the engine cannot answer any more (a process died)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.receive_loop())

    async def receive_loop(self) -> None:
        while True:
            msg = await self.recv.recv_pyobj()
            try:
                self.dispatch(msg)
            except Exception:  # a bug here must not silence every later output
                logger.exception("API server: could not dispatch %s", type(msg).__name__)

    def dispatch(self, msg) -> None:
        if isinstance(msg, BatchStrOut):
            for out in msg.outputs:
                handle = self.handles.get(out.rid)
                if handle is None:  # aborted: nobody waits for it
                    continue
                if out.finished:
                    del self.handles[out.rid]
                handle.queue.put_nowait(out)
        elif isinstance(msg, ControlOut):
            future = self.controls.pop(msg.req_id, None)
            if future is not None and not future.done():
                future.set_result(msg.result)
        else:
            logger.error("API server: unexpected message %s", type(msg).__name__)

    async def generate(self, prompts: list[dict], sampling_params: dict, n: int = 1,
                       return_logprob: bool = False, top_logprobs_num: int = 0,
                       **options) -> RequestHandle:
        """prompts: GenerateReqInput fields of each prompt ({"text"}, {"input_ids"} or
        {"messages"}). Choice index = prompt index * n + copy, as OpenAI numbers them. options:
        GenerateReqInput's other fields (logprob_start_len, echo)."""
        self.check_alive()
        handle = RequestHandle(self)
        for prompt in prompts:
            rids = [next(self.ids) for _ in range(n)]
            for rid in rids:
                handle.index[rid] = len(handle.index)
                handle.unfinished.add(rid)
                self.handles[rid] = handle
            msg = GenerateReqInput(rids, sampling_params, return_logprob=return_logprob,
                                   top_logprobs_num=top_logprobs_num, **options, **prompt)
            await self.to_tokenizer.send_pyobj(msg)
        return handle

    async def abort(self, rids: list[int]) -> None:
        for rid in rids:
            if self.handles.pop(rid, None) is not None and self.dead is None:
                await self.to_tokenizer.send_pyobj(AbortReq(rid))

    async def control(self, kind: str, check_integrity: bool = False) -> dict:
        """Ask the scheduler ("status", "flush_cache"); its reply comes straight back on our
        inbox."""
        self.check_alive()
        req_id = next(self.ids)
        future = self.controls[req_id] = asyncio.get_running_loop().create_future()
        await self.to_tokenizer.send_pyobj(ControlReq(req_id, kind, check_integrity))
        try:
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.controls.pop(req_id, None)
            raise APIError(
                503,
                f"the scheduler did not answer {kind!r} within {CONTROL_TIMEOUT_S:.0f} s") from None

    def check_alive(self) -> None:
        if self.dead is not None:
            raise APIError(503, f"the engine is shutting down: {self.dead}", code="engine_dead")

    def fail_all(self, reason: str) -> None:
        """A process died, or the server is shutting down: every waiting request ends with a 503 now
        (a stream: an error event and [DONE]), instead of waiting forever; nothing more is sent."""
        self.dead = reason
        for rid, handle in list(self.handles.items()):
            handle.queue.put_nowait(
                ReqOutput(rid, finished=True, finish_reason="error",
                          error=f"the engine stopped: {reason}", error_code="engine_dead"))
        self.handles.clear()
        for future in self.controls.values():
            if not future.done():
                future.set_exception(
                    APIError(503, f"the engine stopped: {reason}", code="engine_dead"))

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.ctx.destroy(linger=0)
