"""The scheduler process: the stage's Scheduler in a loop, fed by a socket instead of a Python call.

    loop:
        receive: block on the socket (zmq poll, with a timeout) when there is no work; drain it
                 without blocking when there is: new requests -> add_req, aborts -> abort_request,
                 flush_cache, in arrival order
        step():  the LLM's step: every rank applies this turn's operations in that order, then one
                 forward pass
        send:    the step's token ids (and finish reasons, logprobs) to the detokenizer, one message
                 per step; the replies to this turn's control requests, which now see the flush done

The loop never waits for a client, never decodes text and never holds the GIL of the HTTP process:
the only thing that can stall it is the forward pass itself. Stop strings are still checked here,
with the scheduler's own incremental detokenizer for the requests that have them (as SGLang does):
the scheduler is the one that must stop generating, and a round trip to the detokenizer would let it
decode tokens nobody will see.
"""

from __future__ import annotations

import logging
import os

import zmq

from ..core import Req
from ..llm import LLM
from ..scheduler import StepOutput
from ..server_args import ServerArgs
from .messages import (AbortReq, BatchTokenIDOut, BatchTokenizedGenerateReqInput, ControlOut,
                       ControlReq, EngineInfo, PortArgs, ReqOutput, TokenizedGenerateReqInput,
                       TokenLogprob, error_output)
from .process import POLL_TIMEOUT_MS, ChildProcess, open_sockets

logger = logging.getLogger(__name__)


class SchedulerLoop:
    """Drives the LLM's add / step / abort (the same calls as offline) from the socket; reads the
    Scheduler's state (llm.scheduler) for the status."""

    def __init__(self, llm: LLM, recv: zmq.Socket, to_detokenizer: zmq.Socket, to_api: zmq.Socket):
        self.llm, self.scheduler = llm, llm.scheduler
        self.recv, self.to_detokenizer, self.to_api = recv, to_detokenizer, to_api
        # copies of a prompt (n > 1), added one step late
        self.later: list[TokenizedGenerateReqInput] = []
        # rids whose first output (with their stop strings) is not sent yet
        self.unannounced: set[int] = set()
        # answered after this turn's step has applied their operations
        self.controls: list[ControlReq] = []
        self.prompt_texts: dict[int, str] = {}  # echo requests' prompts, for their first output
        self.num_aborted = 0  # requests aborted while unfinished (clients that went away)

    def has_work(self) -> bool:
        s = self.scheduler
        return (self.llm.has_unfinished_requests() or self.llm.has_pending_ops
                or bool(s.inflight or s.ready_outputs or self.later))

    def run_once(self, poll_timeout_ms: int = POLL_TIMEOUT_MS) -> None:
        """One turn of the loop: receive (blocking only when idle), step, send."""
        copies, self.later = self.later, []
        for req in copies:  # their prompt was admitted last step: it is in the radix cache now
            self.add(req)
        if not self.has_work():
            # sleeps until a message arrives (or the timeout): no busy-waiting
            self.recv.poll(poll_timeout_ms)
        while True:  # drain: everything already queued joins this step
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.handle(msg)
        if self.has_work():
            # An abort reads its request's launched step first; those tokens are nobody's now
            # (abort() said so).
            outputs = [o for o in self.llm.step() if o.req.finish_reason != "abort"]
            if outputs:
                self.to_detokenizer.send_pyobj(
                    BatchTokenIDOut([self.to_message(o) for o in outputs]))
        controls, self.controls = self.controls, []
        for msg in controls:
            self.to_api.send_pyobj(
                ControlOut(msg.req_id, self.control(msg.kind, msg.check_integrity)))

    def handle(self, msg) -> None:
        if isinstance(msg, BatchTokenizedGenerateReqInput):
            first, *rest = msg.reqs
            self.add(first)
            self.later += rest
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, ControlReq):
            if msg.kind == "flush_cache":
                # in this turn's list, after what arrived before it: on every rank
                self.llm.flush_cache()
            self.controls.append(msg)
        else:
            logger.error("scheduler: unexpected message %r", type(msg).__name__)

    def add(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, return_logprob=msg.return_logprob,
                  top_logprobs_num=msg.top_logprobs_num, logprob_start_len=msg.logprob_start_len)
        try:
            self.llm.add_req(req)
        # the tokenizer worker checks the same things: this is the last line
        except ValueError as exc:
            self.to_detokenizer.send_pyobj(BatchTokenIDOut([error_output(msg.rid, str(exc))]))
            return
        self.unannounced.add(req.rid)
        if msg.prompt_text is not None:
            self.prompt_texts[req.rid] = msg.prompt_text

    def abort(self, rid: int) -> None:
        """The client went away: finish the request now, so its pages go back to the pool (and its
        full pages to the radix cache). The detokenizer hears of it too, to drop its state."""
        unfinished = self.llm.has_request(rid) or any(r.rid == rid for r in self.later)
        self.later = [r for r in self.later if r.rid != rid]
        if self.llm.has_request(rid):
            self.llm.abort_request(rid)
        self.num_aborted += unfinished
        self.unannounced.discard(rid)
        self.prompt_texts.pop(rid, None)
        self.to_detokenizer.send_pyobj(
            BatchTokenIDOut([ReqOutput(rid, finished=True, finish_reason="abort")]))

    def to_message(self, out: StepOutput) -> ReqOutput:
        req = out.req
        # a grammar that did not compile (the client gets a 400 with the reason), or a request
        # whose own work raised ("internal_error": the server's fault; the others went on)
        if out.error is not None:
            self.unannounced.discard(out.rid)
            self.prompt_texts.pop(out.rid, None)
            return error_output(out.rid, out.error, out.error_code)
        msg = ReqOutput(out.rid, out.new_token_ids, out.finished, out.finish_reason,
                        req.matched_stop, len(req.input_ids), req.cached_tokens)
        if out.rid in self.unannounced:
            self.unannounced.discard(out.rid)
            msg.stop_strings = req.sampling_params.stop_strings
        if out.logprob is not None:
            msg.logprobs = [TokenLogprob(out.new_token_ids[0], out.logprob, out.top_logprobs or [])]
        if out.input_token_logprobs is not None:  # the prompt's, from logprob_start_len on
            start, ids = req.logprob_start_len, req.input_ids
            msg.input_logprobs = [TokenLogprob(ids[0], None, [])] if start == 0 else []
            msg.input_logprobs += [TokenLogprob(ids[t], lp, top) for t, (lp, top) in
                                   enumerate(out.input_token_logprobs, max(start, 1))]
        msg.prompt_text = self.prompt_texts.pop(out.rid, None)
        if out.finished:
            self.unannounced.discard(out.rid)
        return msg

    def control(self, kind: str, check_integrity: bool = False) -> dict:
        s = self.scheduler
        # a flush was applied by the step before this reply
        if kind not in ("status", "flush_cache"):
            return {"error": f"unknown control request {kind!r}"}
        integrity = "not checked (GET /get_server_info?check=1 walks every page and the whole tree)"
        if check_integrity:
            try:
                s.check_integrity()
                integrity = "ok"
            except AssertionError as exc:
                integrity = f"FAILED: {exc}"
        cache = s.cache
        return {
            "num_running": len(s.decoder.running), "num_waiting": len(s.waiting),
            "num_total_pages": cache.pool.num_pages, "num_free_pages": cache.num_free_pages,
            "num_evictable_pages": cache.num_evictable_pages,
            "num_used_pages": cache.num_used_pages, "page_size": cache.page_size,
            "tree_tokens": s.tree_tokens, "cache_hit_rate": s.cache_hit_rate,
            "num_preemptions": s.total_preemptions, "num_aborted_requests": self.num_aborted,
            "prompt_tokens_admitted": s.admitted_tokens, "prompt_tokens_cached": s.cached_tokens,
            "integrity": integrity, "pid": os.getpid()
        }


def run_scheduler(server_args: ServerArgs, verbose: bool, ports: PortArgs, ready_conn) -> None:
    """Entry point of the scheduler process: build the engine and its Scheduler, say ready, loop.

    Under tensor parallelism one such process runs per rank, each with its share of the weights.
    Rank 0 alone owns these sockets: it receives the requests and, every turn of the loop,
    broadcasts what it received (adds, aborts, flushes, in arrival order) to the other ranks, so
    that every rank applies the same operations in the same order and schedules the same batches;
    only rank 0 sends outputs on (SGLang's shape)."""
    child = ChildProcess("scheduler", ready_conn)
    if server_args.log_interval:  # the scheduler's throughput log (--log-interval) is written here
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        # engine + tokenizer + scheduler, as offline
        llm = LLM.from_server_args(server_args, verbose=verbose)
        scheduler = llm.scheduler
        scheduler.stream_text = False  # text is the detokenizer's job; stop strings stay here
        engine = llm.engine
        info = EngineInfo(engine.max_context_len, engine.config.vocab_size,
                          engine.kv_pool.num_pages * engine.kv_pool.page_size,
                          engine.kv_pool.page_size)
        recv, to_detokenizer, to_api = open_sockets(ports.scheduler_input_ipc_name,
                                                    ports.detokenizer_ipc_name, ports.api_ipc_name)
    except Exception:
        child.failed()
    child.ready(info)
    loop = SchedulerLoop(llm, recv, to_detokenizer, to_api)
    while child.parent_alive():
        loop.run_once()
