"""Launching a batch (SGLang: Scheduler.run_batch): prepare its tensors, advance every request as
if its step were done (the token each row samples is a placeholder until the step is read back:
output_processor.py), and submit the forward pass and sampling to the device worker (overlap.py).

A plain function, not a method: it takes the Scheduler whose requests it advances.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..beam_search import BeamReq, keep_top_logprobs
from ..core import Batch
from ..sampler import sample_tensor
from .overlap import StepTiming

if TYPE_CHECKING:  # scheduler.py imports this module
    from .scheduler import Scheduler


def run_batch(scheduler: Scheduler, batch: Batch, start: float) -> None:
    """Prepare the batch's tensors, advance every request as if its step were done, and submit
    the step."""
    # reads the placeholders of the step before, if it is still running
    fb = scheduler.engine.prepare(batch)
    scheduler.last_phase = batch.phase
    if batch.phase == "prefill":
        scheduler.chunked = None  # set again below if this batch cut a prompt
    sample_rows, sampled = [], []  # sampled: (request, index of its new token in output_ids)
    for i, req in enumerate(batch.reqs):
        # a non-final prefill chunk: nothing to sample yet
        if req.device_len < len(req.all_ids):
            req.complete_chunk()
            # stage 6: the chunk's pages join the tree at once
            scheduler.cache.cache_unfinished(req)
            scheduler.chunked = req
            continue
        if batch.phase == "prefill":
            scheduler.decoder.add(req)  # prompt done: from now on it decodes
        req.complete_one(-(req.table_idx + 1))  # placeholder: "the token this row samples now"
        if batch.phase == "prefill":
            # Stage 6: the prompt's pages join the tree now, not when the request ends, so
            # requests with the same prefix that arrive while it decodes reuse them. Safe before
            # the batch has run: whoever reads them is in a later batch, which the device runs
            # after this one.
            scheduler.cache.cache_unfinished(req)
        sample_rows.append(i)
        sampled.append((req, len(req.output_ids) - 1))
    reqs = [r for r, _ in sampled]
    gens = [scheduler.generators.get(r.rid) for r in reqs]
    engine = scheduler.engine
    # [S]
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.long, device=engine.device)
    # [S] rows of the logits that sample; None when all do (a decode step): no copy of the logits
    sel = (None if len(sample_rows) == len(batch.reqs)
           else torch.tensor(sample_rows, dtype=torch.long, device=engine.device))

    def device_step() -> torch.Tensor:  # runs on the device worker
        logits = engine.run(fb)  # [B, vocab]
        if not reqs:
            return torch.empty(0, dtype=torch.long, device=engine.device)
        logits = logits[: len(reqs)] if sel is None else logits[sel]  # [S, vocab]
        beams = [j for j, r in enumerate(reqs) if isinstance(r, BeamReq)]  # beam search's requests
        if beams:  # each keeps its best next tokens' log-probabilities (beam_search.py)
            keep_top_logprobs([reqs[j] for j in beams], logits[beams])
        tokens = sample_tensor(logits, reqs, gens)  # [S], on the device
        engine.future_tokens[rows] = tokens  # the next step's placeholders read them here
        return tokens

    timing = StepTiming(scheduler.step_count, batch.phase, batch.size, (start, time.perf_counter()))
    # Alive until the step is read back: on CUDA the forward stream reads them after this thread
    # drops them. fb.input_ids is listed on its own because engine.run replaces it with the
    # resolved ids.
    keep_alive = [fb, fb.input_ids, rows, sel]
    # without overlap, this runs the step before returning
    pending = scheduler.worker.submit(device_step)
    pending.timing, pending.keep_alive = timing, keep_alive
    scheduler.inflight.append((batch, sampled, pending))
