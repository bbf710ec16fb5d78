"""Pick the next token of every request in a batch at once, each with its own SamplingParams, on the
device.

Order of operations (as in SGLang / vLLM):
1. penalties on the raw logits: repetition (prompt + output tokens; positive logits are divided by
   it, negative ones multiplied), frequency (minus count in the output times the penalty), presence
   (minus the penalty once a token has appeared in the output);
2. greedy rows take the argmax now;
3. temperature, then top-k, top-p and min-p as masks over one shared sort;
4. draw with the "exponential race": argmax(p / E), E ~ Exp(1) i.i.d., picks token i with
   probability p_i and lets each request draw its noise from its own seeded generator, so a seeded
   request samples the same tokens whatever batch it happens to run in.
"""

from __future__ import annotations

import torch

from .core import Req


def apply_penalties(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """logits: [B, V] -> penalised copy. Only rows of requests that ask for penalties are
    touched."""
    logits = logits.clone()
    V = logits.shape[1]
    for b, req in enumerate(reqs):
        p = req.sampling_params
        if not p.has_penalties:
            continue
        row = logits[b]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(
                torch.tensor(req.output_ids, dtype=torch.long, device=row.device), minlength=V)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def sample(logits: torch.Tensor, reqs: list[Req],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, vocab] -> B token ids."""
    params = [r.sampling_params for r in reqs]
    if any(p.has_penalties for p in params):
        logits = apply_penalties(logits, reqs)
    greedy_ids = logits.argmax(dim=-1)  # [B]
    if all(p.is_greedy for p in params):
        return greedy_ids.tolist()  # the fast path: no softmax, no sort, no random numbers
    B, V = logits.shape
    device = logits.device
    temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                               device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)

    logits = logits.float() / temperature[:, None]  # [B, V]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(V, device=device)[None, :]  # [1, V]
    # top-k keeps ranks < k; top-p keeps the smallest prefix whose mass reaches p (drop a token when
    # the mass before it already does); min-p drops tokens less likely than min_p times the best.
    # The best always survives.
    drop = (rank >= top_k[:, None]) | ((sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None])
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
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
