"""What happens to a step's tokens (SGLang: scheduler_output_processor_mixin.py): each joins its
request, the stop checks run, the requests that stopped finish (their pages go back to the cache)
and every request's news goes back to the caller as a StepOutput.

Plain functions, not methods: each takes the Scheduler whose requests it updates; scheduler.py keeps
the loop that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core import Batch, Req, ReqStatus
from ..sampler import sample

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


def process_batch_result(scheduler: Scheduler, batch: Batch,
                         logits: torch.Tensor) -> list[StepOutput]:
    """Advance every request of the batch; sample for those whose last fed token predicts a new
    one."""
    sample_rows, to_sample = [], []
    if batch.phase == "prefill":
        scheduler.chunked = None  # set again below if this batch cut a prompt
    for i, req in enumerate(batch.reqs):
        # a non-final prefill chunk: nothing to sample yet
        if req.device_len < len(req.all_ids):
            req.complete_chunk()
            scheduler.chunked = req
        else:
            sample_rows.append(i)
            to_sample.append(req)
    if not to_sample:
        return []
    token_ids = sample(logits[sample_rows], to_sample,
                       [scheduler.generators[r.rid] for r in to_sample])
    outputs = []
    for req, token_id in zip(to_sample, token_ids):
        if batch.phase == "prefill":
            scheduler.decoder.add(req)  # prompt done: from now on it decodes
        req.complete_one(token_id)
        check_finished(scheduler, req, token_id)
        req.check_invariants()
        detok = scheduler.detok.pop(req.rid, None) if req.finished else scheduler.detok.get(req.rid)
        delta = detok.take_delta(final=req.finished) if detok else ""
        outputs.append(
            StepOutput(req.rid, [token_id], delta, req.finished, req.finish_reason, req))
    return outputs


def check_finished(scheduler: Scheduler, req: Req, token_id: int) -> None:
    params = req.sampling_params
    detok = scheduler.detok.get(req.rid)
    matched_string = detok.add(token_id) if detok else None
    if token_id in params.stop_token_ids:
        finish_request(scheduler, req, "stop", token_id)
    elif token_id in scheduler.engine.eos_token_ids and not params.ignore_eos:
        finish_request(scheduler, req, "stop", token_id)
    elif matched_string is not None:
        finish_request(scheduler, req, "stop", matched_string)
    elif len(req.output_ids
             ) >= params.max_new_tokens or req.device_len >= scheduler.engine.max_context_len:
        finish_request(scheduler, req, "length")


def finish_request(scheduler: Scheduler, req: Req, reason: str, matched=None) -> None:
    """The request ends for `reason` (matched: the stop token or string): its pages go back to
    the cache and the scheduler's books drop it."""
    req.status, req.finish_reason, req.matched_stop = ReqStatus.FINISHED, reason, matched
    if req.table_idx >= 0:
        scheduler.cache.release(req)
    scheduler.reqs.pop(req.rid, None)
    scheduler.generators.pop(req.rid, None)
