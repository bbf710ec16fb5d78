"""Pick the next token of every request in a batch at once, each with its own SamplingParams, on the
device.

Order of operations (as in SGLang / vLLM):
1. penalties on the raw logits: repetition (prompt + output tokens; positive logits are divided by
   it, negative ones multiplied), frequency (minus count in the output times the penalty), presence
   (minus the penalty once a token has appeared in the output);
2. greedy rows take the argmax now (temperature below GREEDY_TEMPERATURE or top_k 1: dividing by a
   temperature of 1e-300 would overflow every logit to inf, SamplingParams.is_greedy);
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
            # ids < 0: stage 5's placeholder for the very token being sampled now (not seen yet)
            seen = torch.tensor(sorted(t for t in set(req.all_ids) if t >= 0), dtype=torch.long,
                                device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            out = [t for t in req.output_ids if t >= 0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long, device=row.device),
                                    minlength=V)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def sample(logits: torch.Tensor, reqs: list[Req],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, vocab] -> B token ids on the host (waits for the device)."""
    return sample_tensor(logits, reqs, generators).tolist()


def sample_tensor(logits: torch.Tensor, reqs: list[Req],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, vocab] -> [B] token ids left on the device: no host sync, so the overlap
    scheduler can feed them to the next step before the CPU has read them (stage 5)."""
    params = [r.sampling_params for r in reqs]
    if any(p.has_penalties for p in params):
        logits = apply_penalties(logits, reqs)
    greedy_ids = logits.argmax(dim=-1)  # [B]
    if all(p.is_greedy for p in params):
        return greedy_ids  # the fast path: no softmax, no sort, no random numbers
    B, V = logits.shape
    device = logits.device
    temperature = _on_device([1.0 if p.is_greedy else p.temperature for p in params], device)
    top_k = _on_device([p.top_k if p.top_k > 0 else V for p in params], device)
    top_p = _on_device([p.top_p for p in params], device)
    min_p = _on_device([p.min_p for p in params], device)

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
    is_greedy = _on_device([p.is_greedy for p in params], device)
    return torch.where(is_greedy, greedy_ids, sampled_ids)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   top_k: int) -> tuple[torch.Tensor, ...]:
    """The log-probabilities a server returns (stage 8's logprobs): logits [R, vocab], token_ids [R]
    -> the chosen tokens' logprobs [R], and the top_k most likely tokens' logprobs and ids [R,
    top_k]. From the model's own distribution (raw logits: before penalties and temperature), as
    vLLM reports them by default."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]  # [R]
    top_values, top_ids = logprobs.topk(top_k, dim=-1)  # [R, top_k] each
    return chosen, top_values, top_ids


def logprobs_to_host(found: dict) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """A step's logprob tensors (the scheduler's launch) -> host values by position in the step's
    sampled list."""
    if not found:
        return {}
    chosen, values, ids = (t.tolist() for t in found["values"])
    return {j: (c, list(zip(i, v))) for j, c, v, i in zip(found["rows"], chosen, values, ids)}


def _on_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor. On CUDA through pinned memory without blocking: this
    runs on the overlap worker's stream, and a plain (pageable) copy would make the host wait for
    the whole forward queued before it, so the worker could not launch the next step until the
    device ran dry."""
    host = torch.tensor(values)
    if device.type != "cuda":
        return host.to(device)
    # torch's pinned-memory cache keeps it until copied
    return host.pin_memory().to(device, non_blocking=True)
