"""The detokenizer worker: token ids in, text deltas out (SGLang's DetokenizerManager).

    scheduler ──BatchTokenIDOut──▶ [one IncrementalDetokenizer per request] ──BatchStrOut──▶ API
        server

Why a process of its own: decoding is per token and per request, a few tokenizer calls each, every
step. In the scheduler it would add that to every step's host time; in the API server it would
compete with the event loop that writes every client's stream. Here it runs while the scheduler
computes the next step.

Each request's IncrementalDetokenizer (the stage's detokenizer.py, unchanged) emits only complete
UTF-8 characters and holds back text that may be the start of a stop string. The scheduler decides
that a request stopped (it checks stop strings with its own detokenizer state); this process sees
the same tokens, finds the same match and trims the text there, so neither the stop string nor
anything after it reaches the client.
"""

from __future__ import annotations

import logging

from ..detokenizer import IncrementalDetokenizer
from ..tokenizer import Tokenizer
from .messages import BatchStrOut, BatchTokenIDOut, PortArgs, ReqOutput, error_output
from .process import POLL_TIMEOUT_MS, ChildProcess, open_sockets

logger = logging.getLogger(__name__)


class DetokenizerWorker:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        # rid -> decoding state, until it finishes
        self.states: dict[int, IncrementalDetokenizer] = {}

    def handle(self, batch: BatchTokenIDOut) -> BatchStrOut:
        outputs = []
        for out in batch.outputs:
            try:
                outputs.append(self.detokenize(out))
            except Exception as exc:  # this request fails alone
                logger.exception("detokenizing request %s failed", out.rid)
                self.states.pop(out.rid, None)
                outputs.append(error_output(out.rid, f"detokenization failed: {exc}", None))
        return BatchStrOut(outputs)

    def detokenize(self, out: ReqOutput) -> ReqOutput:
        if out.finish_reason in ("abort", "error"):
            self.states.pop(out.rid, None)
            return out
        state = self.states.get(out.rid)
        if state is None:
            state = self.states[out.rid] = IncrementalDetokenizer(self.tokenizer,
                                                                  out.stop_strings or [])
        for token_id in out.token_ids:
            state.add(token_id)  # a stop string found here is the one the scheduler stopped at
        out.text = state.take_delta(final=out.finished)
        if out.finished:
            del self.states[out.rid]
        for lp in (out.input_logprobs or []) + (out.logprobs or []):
            lp.text = self.token_text(lp.token_id)
            lp.top_texts = [self.token_text(t) for t, _ in lp.top]
        return out

    def token_text(self, token_id: int) -> str:
        """One token alone, as OpenAI's logprobs show it (may be a fragment of a multi-byte
        character)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def run_detokenizer_worker(model_path: str, ports: PortArgs, ready_conn) -> None:
    """Entry point of the detokenizer worker process."""
    child = ChildProcess("detokenizer worker", ready_conn)
    try:
        worker = DetokenizerWorker(Tokenizer(model_path))
        recv, to_api = open_sockets(ports.detokenizer_ipc_name, ports.api_ipc_name)
    except Exception:
        child.failed()
    child.ready()
    while child.parent_alive():
        if recv.poll(POLL_TIMEOUT_MS):
            to_api.send_pyobj(worker.handle(recv.recv_pyobj()))
