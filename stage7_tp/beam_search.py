"""Beam search whose beams share their prefix pages (`LLM.beam_search`, vLLM's offline API shape).

Beam search keeps the `beam_width` (k) most likely continuations of a prompt, by total
log-probability, instead of one greedy one. Each round every live beam proposes its best next
tokens, and the k best (beam + token) pairs over all beams become the next round's beams: a good
beam may fork into several, a poor one dies. Scoring, length penalty and early stopping follow
Hugging Face `generate(num_beams=k, do_sample=False)` step by step, so the best sequence and its
score are theirs.

The engine needs no new kind of batch. A round is one **one-token request per live beam**, whose
prompt is the beam's tokens so far: admission matches all of them but the last in the radix tree,
where the parent beam's request left them the round before, so only that last token is computed and
the fork's page-table row starts with its parent's pages: nothing recomputed, nothing copied
(`page_size` 1). With `page_size` P > 1 the tree shares whole pages only: a fork shares its parent's
full pages and recomputes the tokens of its partial last page (at most P - 1), where SGLang would
copy that page. The request keeps the log-probabilities of its best next tokens (`BeamReq`, filled
in the device step by `keep_top_logprobs`) and finishes; its pages stay in the tree for its forks,
and the pruned beams' pages are evicted like any unused prefix.

    round t:   beams (tokens_i, score_i) -> requests prompt + tokens_i  (one token computed each)
               -> top log-probs of each -> candidates score_i + log p(token | beam i)
               -> the best k that do not stop continue; those that stop (EOS, or max_new_tokens)
                  join the finished hypotheses, scored sum / len ** length_penalty
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from .core import Req, SamplingParams

if TYPE_CHECKING:  # llm.py imports this module
    from .llm import LLM

# Each beam is a request of its own in a round: beyond this many the rounds get long.
MAX_BEAM_WIDTH = 64
EARLY_STOPPING = (True, False, "never")


@dataclass
class BeamReq(Req):
    """One beam's one-token request: it keeps the log-probabilities of its top_n best next
    tokens."""

    top_n: int = 1
    top_logprobs: tuple | None = None  # ([top_n] float32 log-probabilities, [top_n] token ids)


def keep_top_logprobs(reqs: list[BeamReq], logits: torch.Tensor) -> None:
    """In the device step: logits [B, vocab] of B beam requests -> each keeps its top_n entries of
    the log-softmax over the whole vocabulary (in float32, as Hugging Face scores them)."""
    n = max(r.top_n for r in reqs)
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(n, dim=-1)  # [B, n] each
    for req, v, i in zip(reqs, values, ids):
        req.top_logprobs = (v[: req.top_n], i[: req.top_n])


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated ids only (ending with the stop token when it stopped)
    text: str
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what beams are ranked by
    cumulative_logprob: float
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass
class BeamSearchResult:
    prompt_token_ids: list[int]
    sequences: list[BeamHypothesis]  # the beam_width best finished hypotheses, best first

    @property
    def token_ids(self) -> list[int]:
        return self.sequences[0].token_ids

    @property
    def text(self) -> str:
        return self.sequences[0].text


@dataclass
class BeamState:
    """One prompt's beams: the live ones, the finished hypotheses, and when to stop (HF's rules)."""

    prompt_ids: list[int]
    beam_width: int
    max_new_tokens: int
    stop_ids: set[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # live beams: (generated ids, float32 sum of log-probabilities). Round 0 has one: HF starts the
    # other k - 1 copies of the prompt at -1e9, so none of their continuations is ever chosen.
    running: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])
    finished: list[tuple[float, list[int], float, str]] = field(default_factory=list)
    improvable: bool = True  # can a live beam still beat the worst finished one? (sticky, as HF)
    done: bool = False

    @property
    def top_n(self) -> int:
        """Candidates kept per round (HF's beams_to_keep): enough that k survive even if every
        beam's best tokens are stop tokens."""
        return max(2, 1 + len(self.stop_ids)) * self.beam_width

    def advance(self, top: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One round: top[i] = (log-probs, token ids) of live beam i's best top_n next tokens."""
        k, t = self.beam_width, len(self.running[0][0])  # t tokens generated so far by each beam
        scores = torch.tensor([s for _, s in self.running], dtype=torch.float32)  # [beams]
        values = torch.stack([v.cpu() for v, _ in top]) + scores[:, None]  # [beams, top_n]
        ids = torch.stack([i.cpu() for _, i in top])  # [beams, top_n]
        flat, order = values.flatten().sort(descending=True, stable=True)
        n = values.shape[1]
        running, new_finished = [], []
        is_full = len(self.finished) == k and self.early_stopping is True
        all_stop = True
        for rank, (score, index) in enumerate(zip(flat[: self.top_n], order[: self.top_n])):
            beam, token = int(index) // n, int(ids.flatten()[index])
            tokens = self.running[beam][0] + [token]
            stops = token in self.stop_ids or t + 1 >= self.max_new_tokens
            all_stop &= stops
            if not stops:
                running.append((tokens, float(score)))
            elif rank < k and not is_full:  # only the top k candidates may finish (HF)
                reason = "length" if token not in self.stop_ids else "stop"
                new_finished.append(
                    (float(score / (t + 1) ** self.length_penalty), tokens, float(score), reason))
        self.running = running[:k]
        self.finished = sorted(self.finished + new_finished, key=lambda f: -f[0])[:k]
        # Stop when nothing can continue, when early_stopping=True has k finished, or when the best
        # live beam cannot beat the worst finished one (HF's heuristic: it scores the live beam at
        # its current length, or at max_new_tokens under "never" with a positive length penalty).
        best_len = (self.max_new_tokens if self.early_stopping == "never" and
                    self.length_penalty > 0 else t + 1)
        full = len(self.finished) == k
        if self.running:
            best = float(torch.tensor(self.running[0][1], dtype=torch.float32) /
                         best_len ** self.length_penalty)
            worst = min(f[0] for f in self.finished) if full else -1e9
            self.improvable = self.improvable and best > worst
        self.done = all_stop or not self.improvable or (full and self.early_stopping is True)


def check_beam_args(beam_width, max_new_tokens, length_penalty, early_stopping) -> None:
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or \
            not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be an int in [1, {MAX_BEAM_WIDTH}], got {beam_width!r}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or \
            max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not abs(length_penalty) < float("inf"):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not any(early_stopping is e for e in EARLY_STOPPING):
        raise ValueError(f"early_stopping must be True, False or \"never\", got {early_stopping!r}")


def beam_search(llm: LLM, prompts: Sequence, beam_width: int, max_new_tokens: int,
                length_penalty: float = 1.0, early_stopping: bool | str = False,
                stop_token_ids: Sequence[int] = ()) -> list[BeamSearchResult]:
    """Run every prompt's beams together, one round (one token per beam) per loop."""
    if isinstance(early_stopping, str) and early_stopping == "never":
        early_stopping = "never"  # `is` comparisons below, as HF's
    check_beam_args(beam_width, max_new_tokens, length_penalty, early_stopping)
    stop_ids = set(llm.engine.eos_token_ids) | set(SamplingParams(
        stop_token_ids=list(stop_token_ids)).stop_token_ids)
    states = []
    for prompt in prompts:
        ids = llm.encode(prompt)
        if len(ids) + max_new_tokens > llm.engine.max_context_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the context length {llm.engine.max_context_len}")
        states.append(BeamState(ids, beam_width, max_new_tokens, stop_ids, length_penalty,
                                early_stopping))
    vocab = llm.engine.config.vocab_size
    if states and states[0].top_n > vocab:
        raise ValueError(f"beam_width {beam_width} keeps {states[0].top_n} candidates per beam, "
                         f"more than the vocabulary's {vocab} tokens")
    one_token = SamplingParams(max_new_tokens=1, ignore_eos=True)
    while live := [s for s in states if not s.done]:
        round_reqs: list[list[BeamReq]] = []
        try:
            for s in live:  # one request per live beam: its tokens so far, one token to compute
                make = lambda *a, n=s.top_n, **kw: BeamReq(*a, top_n=n, **kw)  # noqa: E731
                round_reqs.append([llm._add(s.prompt_ids + tokens, one_token, 0, make_req=make)
                                   for tokens, _ in s.running])
            while not all(r.finished for reqs in round_reqs for r in reqs):
                llm.step()
        except BaseException:  # refused or interrupted: give this round's pages back
            for reqs in round_reqs:
                for r in reqs:
                    llm.abort_request(r.rid)
            raise
        for s, reqs in zip(live, round_reqs):
            if any(r.top_logprobs is None for r in reqs):
                raise RuntimeError(f"a beam request ended without its log-probabilities: "
                                   f"{[r.finish_reason for r in reqs]}")
            s.advance([r.top_logprobs for r in reqs])
    return [BeamSearchResult(s.prompt_ids, [
        BeamHypothesis(ids, llm.tokenizer.decode(ids), score, cum, reason)
        for score, ids, cum, reason in s.finished]) for s in states]
