"""Prompt logprobs (stage 8): what OpenAI's `echo` with `logprobs` and lm-eval's loglikelihood read.

A request with `logprob_start_len >= 0` wants log p(token t | tokens < t) for each prompt token t
from there on. Position t - 1's logits give it, so a prefill pass that feeds those positions keeps
their logits too: the engine appends their packed rows to `last_token_indices` (engine.prepare), the
model makes [B + P, vocab] logits, the first B sample as always and the P others are scored here, in
the same device step. Only the rows that ask pay: vocab floats per prompt position, and the
log-softmax over them (README, "Prompt logprobs").

Chunked prefill scores each chunk's positions in the pass that feeds it; the radix cache never
serves a position still owed a logprob (Req.max_prefix_len): those are computed again, as in SGLang.
"""

from __future__ import annotations

import torch

from ..core import Batch, Req
from ..sampler import token_logprobs

# What a pass scores: each request and its number of rows (in row order), the target token ids [P]
# on the device, and the most top logprobs any of those requests wants.
PromptTargets = tuple[list[tuple[Req, int]], torch.Tensor, int]


def prompt_logprob_targets(batch: Batch, device: torch.device) -> PromptTargets | None:
    """At launch, before the requests advance: position p of a prompt scores token p + 1. None when
    no request of the batch asked (the usual case)."""
    counts, targets, k = [], [], 0
    for req in batch.reqs:
        positions = req.prompt_logprob_positions()  # the rows engine.prepare appended, in order
        if positions:
            counts.append((req, len(positions)))
            targets += [req.input_ids[p + 1] for p in positions]
            req.input_logprobs_launched += len(positions)
            k = max(k, req.top_logprobs_num)
    if not targets:
        return None
    return counts, torch.tensor(targets, dtype=torch.long, device=device), k


def score_prompt(logits: torch.Tensor, targets: PromptTargets) -> tuple:
    """On the device worker: the scored positions' logits [P, vocab] -> record_prompt_logprobs'."""
    counts, target_ids, k = targets
    return counts, token_logprobs(logits, target_ids, k)  # [P] chosen, [P, k] top values and ids


def record_prompt_logprobs(found: tuple | None) -> None:
    """When the pass is read back: its prompt logprobs onto their requests, in order."""
    if found is None:
        return
    counts, tensors = found
    chosen, values, ids = (t.tolist() for t in tensors)
    row = 0
    for req, n in counts:
        for j in range(row, row + n):
            top = list(zip(ids[j], values[j]))[: req.top_logprobs_num]
            req.input_token_logprobs.append((chosen[j], top))
        row += n
