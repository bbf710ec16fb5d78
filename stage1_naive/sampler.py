"""Turn the logits of the last position into the next token id, for one request."""

from __future__ import annotations

import torch

from .core import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> int:
    """logits: [vocab] -> one token id."""
    if params.is_greedy:
        return int(torch.argmax(logits))  # fast path: no softmax, no sort, no random numbers
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth_largest = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before* it
        # already does.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
