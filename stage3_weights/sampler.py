"""Pick the next token of every request in a batch at once, each with its own SamplingParams.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k and top-p as masks over one
shared sort, then draw with the "exponential race": argmax(p / E) with E ~ Exp(1) i.i.d. picks token
i with probability p_i, and lets each request draw its noise from its own seeded generator, so a
seeded request samples the same tokens whatever batch it happens to run in.
"""

from __future__ import annotations

import torch

from .core import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, vocab] -> B token ids."""
    greedy_ids = logits.argmax(dim=-1)  # [B]
    if all(p.is_greedy for p in params):
        return greedy_ids.tolist()  # the fast path: no softmax, no sort, no random numbers
    B, V = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params],
                               device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)

    logits = logits.float() / temperature[:, None]  # [B, V]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(V, device=device)[None, :]  # [1, V]
    # top-k keeps ranks < k; top-p keeps the smallest prefix whose mass reaches p (drop a token when
    # the mass before it already does). The top-1 token always survives both.
    drop = (rank >= top_k[:, None]) | ((sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # [B, V]
    probs = torch.zeros_like(logits).scatter_(1, order, torch.softmax(sorted_logits, dim=-1))

    noise = torch.empty_like(probs)
    # per-request generators: reproducible regardless of the batch
    for b, gen in enumerate(generators):
        noise[b].exponential_(generator=gen)
    sampled_ids = (probs / noise).argmax(dim=-1)  # [B]
    is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
    return torch.where(is_greedy, greedy_ids, sampled_ids).tolist()
