"""Stage 8: the scheduler process's control operations (requests, aborts, /flush_cache) reach every
tensor-parallel rank as one ordered list, offline and through the server's scheduler loop, and leave nothing
behind at tp 1."""

from __future__ import annotations

import pytest
import zmq

import tp_checks
from stage8_server import LLM, SamplingParams
from stage8_server.server.messages import (AbortReq, BatchTokenizedGenerateReqInput, BatchTokenIDOut, ControlOut,
                                           ControlReq, TokenizedGenerateReqInput)
from stage8_server.server.scheduler_process import SchedulerLoop
from stage8_server.tp_worker import Command


class Inbox:
    """Stands in for a zmq socket: what the test queued comes out of recv_pyobj, what the loop sends is kept."""

    def __init__(self):
        self.queued, self.sent = [], []

    def recv_pyobj(self, flags=0):
        if not self.queued:
            raise zmq.Again()
        return self.queued.pop(0)

    def poll(self, timeout_ms):
        return len(self.queued)

    def send_pyobj(self, msg):
        self.sent.append(msg)


def tiny_llm(path, tp: int) -> LLM:
    return LLM(str(path), attention_backend="torch", tp_size=tp, max_total_tokens=4096,
               enable_tp_sync_check=True, verbose=False)


def test_offline_flush_and_abort_in_one_turn_match_tp_1(tiny_llama_path):
    results = {}
    for tp in (1, 2):
        with tiny_llm(tiny_llama_path, tp) as llm:
            results[tp] = tp_checks.flush_and_abort_in_one_turn(llm, SamplingParams)
    assert [cached for _, cached in results[1]] == [48, 0] and results[2] == results[1]


def serve_flush_and_abort(llm: LLM) -> tuple[list, list]:
    """Through SchedulerLoop: a request decodes; one turn brings /flush_cache and its client's abort (both orders);
    then a request with its prefix. -> ((tokens, cached_tokens) of that request, tree_tokens in each flush reply)."""
    llm.scheduler.stream_text = False  # as run_scheduler sets it
    recv, to_detokenizer, to_api = Inbox(), Inbox(), Inbox()
    loop = SchedulerLoop(llm, recv, to_detokenizer, to_api)
    prefix, results = list(range(10, 60)), []

    def turn(*msgs):
        recv.queued.extend(msgs)
        loop.run_once(0)

    def request(rid, ids, n):
        return BatchTokenizedGenerateReqInput([TokenizedGenerateReqInput(
            rid, ids, SamplingParams(max_new_tokens=n, ignore_eos=True))])

    for i, flush_first in enumerate((True, False)):
        rid, probe = 10 * i, 10 * i + 1
        turn(request(rid, prefix + [1, 2], 50))
        turn()
        turn()
        ops = [ControlReq(i, "flush_cache"), AbortReq(rid)]
        turn(*(ops if flush_first else ops[::-1]))
        turn(request(probe, prefix + [3, 4], 6))
        while loop.has_work():
            loop.run_once(0)
        outs = [o for m in to_detokenizer.sent if isinstance(m, BatchTokenIDOut) for o in m.outputs if o.rid == probe]
        results.append(([t for o in outs for t in o.token_ids], outs[0].cached_tokens))
        turn(ControlReq(100 + i, "flush_cache"))
    replies = {m.req_id: m.result for m in to_api.sent if isinstance(m, ControlOut)}
    assert loop.num_aborted == 2 and all(replies[100 + i]["tree_tokens"] == 0 for i in (0, 1))
    return results, [replies[i]["tree_tokens"] for i in (0, 1)]


def test_the_server_loop_applies_a_turn_in_arrival_order_on_every_rank(tiny_llama_path):
    """/flush_cache and a client disconnect in one scheduler turn: tp 2 gives the tokens and cached counts of tp 1.
    Each flush reply is sent after the step that applied it: it reports the tree as the flush left it."""
    runs = {}
    for tp in (1, 2):
        with tiny_llm(tiny_llama_path, tp) as llm:
            runs[tp] = serve_flush_and_abort(llm)
            if tp == 1:
                assert llm._pending == Command(), "at tp 1 too, a step leaves no operation pending"
    (results, flushed) = runs[1]
    assert [cached for _, cached in results] == [48, 0]
    assert flushed == [48, 0]  # flush first: the flush spared the running request's locked prompt pages
    assert runs[2] == runs[1]


@pytest.mark.parametrize("when", ["same turn", "next turn"])
def test_an_abort_finds_a_request_added_in_the_same_turn(tiny_llama_path, when):
    with tiny_llm(tiny_llama_path, 1) as llm:
        recv, to_detokenizer, to_api = Inbox(), Inbox(), Inbox()
        loop = SchedulerLoop(llm, recv, to_detokenizer, to_api)
        recv.queued.append(BatchTokenizedGenerateReqInput([TokenizedGenerateReqInput(
            7, [1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True))]))
        if when == "next turn":
            loop.run_once(0)
        recv.queued.append(AbortReq(7))
        loop.run_once(0)
        while loop.has_work():
            loop.run_once(0)
        assert loop.num_aborted == 1 and not llm.has_unfinished_requests()
        tokens = [t for m in to_detokenizer.sent for o in m.outputs if o.rid == 7 for t in o.token_ids]
        assert len(tokens) <= 2 and llm.scheduler.cache.num_used_pages == 0
