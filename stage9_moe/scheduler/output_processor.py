"""What happens to a step's tokens (SGLang: scheduler_output_processor_mixin.py): each joins its
request, the stop checks run, the requests that stopped finish (their pages go back to the cache)
and every request's news goes back to the caller as a StepOutput.

Plain functions, not methods: each takes the Scheduler whose requests it updates; scheduler.py keeps
the loop that calls them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import Batch, Req, ReqStatus
from ..sampler import logprobs_to_host
from .overlap import Pending
from .prompt_logprobs import record_prompt_logprobs

if TYPE_CHECKING:  # scheduler.py imports this module
    from .scheduler import Scheduler


@dataclass
class StepOutput:
    """What one request got from one step."""

    rid: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    req: Req  # the request itself (read-only for callers)
    logprob: float | None = None  # stage 8, when req.return_logprob: the token's log-probability
    # and the top_logprobs_num most likely (token id, logprob)
    top_logprobs: list[tuple[int, float]] | None = None
    # With its first token, a request with logprob_start_len >= 0 gets Req.input_token_logprobs.
    input_token_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: str | None = None  # finish_reason "error": why (a grammar that failed to compile)
    # the error's kind for the client: the request's fault, or the server's ("internal_error")
    error_code: str = "invalid_value"


def process_batch_result(scheduler: Scheduler, batch: Batch, sampled: list[tuple[Req, int]],
                         pending: Pending) -> list[StepOutput]:
    """Read one launched step's tokens: fill in placeholders, stop checks, detokenize, release
    finished. A request whose own processing raises fails alone (Scheduler.record_failure); a pass
    that raised fails its batch (Scheduler.fail_batch)."""
    try:
        tokens, events = pending.wait()
        # {index in sampled: (logprob, top (id, logprob) pairs)}; a pass may have prompt ones only
        logprobs = logprobs_to_host(pending.logprobs) if "rows" in pending.logprobs else {}
        record_prompt_logprobs(pending.logprobs.get("prompt"))
    except Exception as exc:  # noqa: BLE001 — the batch's requests end with it, the server goes on
        outputs = scheduler.fail_batch(batch, exc)
        release_deferred(scheduler)
        return outputs
    t0 = time.perf_counter()
    outputs = []
    for j, ((req, index), token_id) in enumerate(zip(sampled, tokens)):
        # it finished at an earlier step (or was aborted) while this one was in flight
        if req.finished or req.rid in scheduler.failures:
            continue
        try:
            outputs.append(read_token(scheduler, req, index, token_id, logprobs.get(j)))
        except Exception as exc:  # noqa: BLE001 — this request alone fails
            scheduler.record_failure(req, exc, "reading its token")
    scheduler.decoder.remove_finished()
    release_deferred(scheduler)
    if pending.timing is not None and scheduler.record_stats:
        pending.timing.device = scheduler.worker.times(events)
        pending.timing.process = (t0, time.perf_counter())
        scheduler.timings.append(pending.timing)
    return outputs


def read_token(scheduler: Scheduler, req: Req, index: int, token_id: int,
               logprob: tuple | None) -> StepOutput:
    """One request's token of a step read back: its stop checks and text -> its StepOutput."""
    req.output_ids[index] = token_id
    check_finished(scheduler, req, token_id, index + 1)
    # drop the launched tokens after the last one
    if req.finished and len(req.output_ids) > index + 1:
        del req.output_ids[index + 1 :]
        req.device_len, req.cached_len = len(req.all_ids), len(req.all_ids) - 1
    req.check_invariants()
    detok = scheduler.detok.pop(req.rid, None) if req.finished else scheduler.detok.get(req.rid)
    delta = detok.take_delta(final=req.finished) if detok and scheduler.stream_text else ""
    value, top = logprob or (None, None)
    out = StepOutput(req.rid, [token_id], delta, req.finished, req.finish_reason, req, value,
                     top[:req.top_logprobs_num] if top is not None else None, error=req.error)
    if index == 0 and req.logprob_start_len >= 0:  # its first token: the prompt is scored
        out.input_token_logprobs = list(req.input_token_logprobs)
    return out


def release_deferred(scheduler: Scheduler) -> None:
    """Finished requests no launched batch holds any more give their pages back."""
    still_launched = {r.rid for b, _, _ in scheduler.inflight for r in b.reqs}
    for req in [r for r in scheduler.deferred if r.rid not in still_launched]:
        scheduler.deferred.remove(req)
        scheduler.cache.release(req, cache_pages=req.error is None)
        scheduler.batch_is_full = False


def check_finished(scheduler: Scheduler, req: Req, token_id: int, num_output: int) -> None:
    """num_output: the request's output length up to this token (later launched tokens are not
    counted)."""
    params = req.sampling_params
    detok = scheduler.detok.get(req.rid)
    matched_string = detok.add(token_id) if detok else None
    # the mask makes it impossible
    if req.grammar is not None and not req.grammar.accept_token(token_id):
        req.error = f"token {token_id} does not follow the request's grammar"
        finish_request(scheduler, req, "error")
    elif token_id in params.stop_token_ids:
        finish_request(scheduler, req, "stop", token_id)
    elif token_id in scheduler.engine.eos_token_ids and not params.ignore_eos:
        finish_request(scheduler, req, "stop", token_id)
    elif matched_string is not None:
        finish_request(scheduler, req, "stop", matched_string)
    # complete, and its stop token taken
    elif req.grammar is not None and req.grammar.is_terminated():
        finish_request(scheduler, req, "stop", token_id)
    elif (num_output >= params.max_new_tokens
          or len(req.input_ids) + num_output >= scheduler.engine.max_context_len):
        finish_request(scheduler, req, "length")


def finish_request(scheduler: Scheduler, req: Req, reason: str, matched=None) -> None:
    """The request ends for `reason` (matched: the stop token or string): its pages go back to
    the cache and the scheduler's books drop it."""
    req.status, req.finish_reason, req.matched_stop = ReqStatus.FINISHED, reason, matched
    scheduler.batch_is_full = False  # its pages come back (now, or once its launched step is read)
    if req.table_idx >= 0:
        if is_launched(scheduler, req):
            # a launched batch may still write its KV pages: release after it
            scheduler.deferred.append(req)
        else:  # a failed request's pages are not cached: its pass may not have written them
            scheduler.cache.release(req, cache_pages=req.error is None)
    scheduler.reqs.pop(req.rid, None)
    scheduler.generators.pop(req.rid, None)


def is_launched(scheduler: Scheduler, req: Req) -> bool:
    """In a batch launched but not read back yet."""
    return any(r is req for b, _, _ in scheduler.inflight for r in b.reqs)
