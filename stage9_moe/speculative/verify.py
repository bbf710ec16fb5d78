"""The accept rules of a verify pass. The target model ran once over [last token, d_1 .. d_k]; row j
of its logits is its distribution for the token after d_1 .. d_j (row 0: after the last token).

Greedy (temperature 0): keep drafts while each equals the target's argmax, then add the target's own
token at the first mismatch (or after the last draft). Every kept token is one the target would have
produced itself, so the output is token-identical to decoding without speculation.

Sampling: rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft x, drawn from q, is
kept with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from the
residual max(0, p - q), renormalised. Each emitted token is then distributed exactly as p, the
target's distribution. A deterministic draft (NGRAM, or a greedy draft model) is q = one-hot(x):
keep x with probability p(x), else draw from p with x removed.
"""

from __future__ import annotations

import torch

from ..core import SamplingParams


def accept_draft(draft: list[int], target: list[int]) -> list[int]:
    """Greedy: target[j] is the target's argmax after draft[:j] (len(draft) + 1 of them). -> the
    longest prefix of draft that matches target, plus the target's own next token."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> list[int]:
    """p: [k + 1, V] the target's probabilities; q: [k, V] the draft's (None: each draft token was
    certain, q = one-hot). -> the accepted drafts plus one token drawn by the rejection rule."""
    out = []
    for j, x in enumerate(draft):
        q_x = 1.0 if q is None else q[j, x]
        accept = torch.clamp(p[j, x] / q_x, max=1.0)
        u = torch.rand((), generator=generator, device=p.device)
        if u < accept:
            out.append(x)
            continue
        if q is None:  # the one-hot residual: p without x
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p[j] - q[j], min=0.0)
        if residual.sum() <= 0:  # p == q (or p was all on x): nothing left to correct
            residual = p[j]
        out.append(draw(residual, generator))
        return out
    out.append(draw(p[len(draft)], generator))  # every draft kept: the target's own next token
    return out


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token index from non-negative weights [V] (renormalised)."""
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> the distribution the sampler draws from [R, V] (sampler.py's order:
    temperature, then top-k, top-p and min-p over one sort). Penalties are not applied: a request
    with penalties gets no drafts."""
    V = logits.shape[-1]
    logits = logits.float() / params.temperature
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [R, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(V, device=logits.device)[None, :]
    top_k = params.top_k if params.top_k > 0 else V
    drop = (rank >= top_k) | ((sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p)
    drop |= sorted_probs < params.min_p * sorted_probs[:, :1]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(logits).scatter_(1, order, probs)
