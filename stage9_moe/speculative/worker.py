"""One verify step: the scheduler's decode batch becomes an extend over each request's last token
and its drafts, and each request advances by as many tokens as were accepted.

    request:  ... The cat sat | on  the  mat        (last token "sat", drafts d1..d3)
    feed:             [sat,     on, the, mat]       one extend, positions L-1 .. L+2
    logits:           row 0    1    2    3          the target's choice after each prefix
    target:           on       the  rug  .
    accept:           on  the  + rug                2 drafts kept, "rug" is the target's own token
    KV:               sat, on, the written and kept; the slot of "mat" is stale, and a page that
                      only rejected drafts used goes back to the free list now

The host state moves as if each accepted token were one decode step (Req.complete_one), and each
token goes through the same stop checks (output_processor.read_token): a stop token, stop string or
max_new_tokens inside the accepted run ends the request exactly where decoding without speculation
would, and only the tokens up to it reach the radix tree. Requests with penalties, logprobs or
nothing to draft verify zero drafts: their row is a plain decode, sampled by sampler.py.

The pass runs eagerly (an extend; CUDA graphs capture only decode batches). When no request of the
batch has a draft, the scheduler runs its plain decode step instead (graph replay on a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core import Batch, Req
from ..sampler import logprobs_to_host, sample_tensor, token_logprobs
from ..scheduler.output_processor import StepOutput, read_token
from .ngram import propose_ngram
from .verify import accept_draft, accept_sampled, target_probs

if TYPE_CHECKING:
    from ..scheduler import Scheduler

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
MAX_BACKOFF = 16  # steps without drafts, at most, after a request's drafts were all rejected
# On a CPU a verify pass over more rows costs more than the drafts save: batch 8 ran at 0.40x of
# speculation off with 2.65 tokens accepted per pass (python -m common.bench speculative), batch 1
# at 2.84x. Larger CPU batches decode without drafts (on a GPU the step is not compute-bound).
CPU_MAX_BATCH = 4


class SpeculativeWorker:
    def __init__(self, algorithm: str, num_draft_tokens: int, draft=None):
        self.algorithm, self.num_draft_tokens = algorithm, num_draft_tokens
        self.draft = draft  # STANDALONE: the DraftWorker (standalone.py)
        # verify passes, request rows verified, drafted tokens, accepted drafts
        self.num_verify_steps = self.num_verify_rows = self.num_drafted = self.num_accepted = 0
        # Adaptive: a request whose drafts were all rejected skips drafting for `backoff` steps,
        # doubling up to MAX_BACKOFF while it keeps failing (text that does not repeat itself pays
        # for few wasted verify passes); one accepted draft resets it. rid -> (backoff, steps left)
        self.backoff: dict[int, tuple[int, int]] = {}

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per request per verify pass (accepted drafts + the target's own)."""
        return 1 + self.num_accepted / self.num_verify_rows if self.num_verify_rows else 1.0

    def check_request(self, req: Req) -> None:
        if req.sampling_params.grammar is not None:
            raise ValueError("structured outputs (json_schema, regex, ebnf) cannot be combined "
                             "with speculative decoding: start the engine without "
                             "--speculative-algorithm")

    def release_finished(self, running: list[Req]) -> None:
        alive = {r.rid for r in running}
        self.backoff = {rid: b for rid, b in self.backoff.items() if rid in alive}
        if self.draft is not None:
            self.draft.release_gone(running)

    def max_drafts(self, scheduler: Scheduler, req: Req) -> int:
        """How many drafts the request may verify: none with penalties or logprobs (their sampler
        reads every earlier token), and never past max_new_tokens or the context."""
        params = req.sampling_params
        if params.has_penalties or req.return_logprob:
            return 0
        backoff, left = self.backoff.get(req.rid, (0, 0))
        if left > 0:
            self.backoff[req.rid] = (backoff, left - 1)
            return 0
        room_output = params.max_new_tokens - len(req.output_ids) - 1
        room_context = scheduler.engine.max_context_len - len(req.all_ids)
        return max(0, min(self.num_draft_tokens, room_output, room_context))

    def propose(self, scheduler: Scheduler, reqs: list[Req]) -> list[list[int]]:
        limits = [self.max_drafts(scheduler, r) for r in reqs]
        if self.draft is not None:
            return self.draft.propose(reqs, limits, scheduler.decoder.running)
        return [propose_ngram(r.all_ids, k) if k else [] for r, k in zip(reqs, limits)]

    def run(self, scheduler: Scheduler, batch: Batch) -> list[StepOutput] | None:
        """Verify the decode batch's drafts. None: no request has a draft (the caller decodes)."""
        reqs, cache, engine = batch.reqs, scheduler.cache, scheduler.engine
        if engine.device.type == "cpu" and len(reqs) > CPU_MAX_BATCH:
            return None
        drafts = self.propose(scheduler, reqs)
        for req, draft in zip(reqs, drafts):
            if draft and not cache.grow(req, req.device_len + len(draft)):
                draft.clear()  # no pages for its drafts now: it decodes one token
        if not any(drafts):
            return None
        # Feed [last token, drafts] of each request: the drafts sit in output_ids for this pass.
        for req, draft in zip(reqs, drafts):
            req.output_ids += draft
            req.device_len += len(draft)
        out_cache_loc = [s for r in reqs for s in cache.slots(r, r.cached_len, r.device_len)]
        fb = engine.prepare(Batch(reqs, "prefill", out_cache_loc))
        fb.last_token_indices = torch.arange(len(out_cache_loc), device=engine.device)  # every row
        try:
            logits = engine.run(fb)  # [sum(k_i + 1), vocab]
        except Exception as exc:  # noqa: BLE001 — as a failed decode pass: its requests end
            return scheduler.fail_batch(batch, exc)
        finally:
            for req, draft in zip(reqs, drafts):
                del req.output_ids[len(req.output_ids) - len(draft):]
                req.device_len -= len(draft)
        outputs, start = [], 0
        for req, draft in zip(reqs, drafts):
            rows = logits[start : start + len(draft) + 1]  # [k_i + 1, vocab]
            start += len(draft) + 1
            tokens, logprob = self.accept(scheduler, req, draft, rows)
            self.num_verify_rows += 1
            self.num_drafted += len(draft)
            self.num_accepted += len(tokens) - 1
            if draft:
                self.adapt(req.rid, len(tokens) - 1)
            try:
                outputs.append(self.advance(scheduler, req, tokens, logprob))
            except Exception as exc:  # noqa: BLE001 — this request alone fails (a stop check, say)
                scheduler.record_failure(req, exc, "reading its tokens")
        self.num_verify_steps += 1
        scheduler.decoder.remove_finished()
        return outputs

    def adapt(self, rid: int, accepted: int) -> None:
        if accepted:
            self.backoff.pop(rid, None)
        else:
            backoff = min(2 * self.backoff.get(rid, (0, 0))[0] or 1, MAX_BACKOFF)
            self.backoff[rid] = (backoff, backoff)

    def accept(self, scheduler: Scheduler, req: Req, draft: list[int],
               rows: torch.Tensor) -> tuple[list[int], tuple | None]:
        """-> the tokens the request emits this step, and (without drafts) its logprob entry."""
        params, gen = req.sampling_params, scheduler.generators.get(req.rid)
        if not draft:  # a plain decode row: the sampler as without speculation
            token = sample_tensor(rows, [req], [gen])  # [1]
            logprob = None
            if req.return_logprob:
                values = token_logprobs(rows, token, req.top_logprobs_num)
                logprob = logprobs_to_host({"rows": [0], "values": values})[0]
            return token.tolist(), logprob
        if params.is_greedy:
            return accept_draft(draft, rows.argmax(dim=-1).tolist()), None
        return accept_sampled(target_probs(rows, params), draft, None, gen), None

    def advance(self, scheduler: Scheduler, req: Req, tokens: list[int],
                logprob: tuple | None) -> StepOutput:
        """Each accepted token as one decode step, with its stop checks; one StepOutput for all."""
        ids, text = [], ""
        for token in tokens:
            req.complete_one(token)  # the token before it now has its K/V in the pool
            out = read_token(scheduler, req, len(req.output_ids) - 1, token, logprob)
            ids.append(token)
            text += out.text_delta
            if req.finished:
                break
        if not req.finished:  # the rejected drafts' pages go back now
            scheduler.cache.trim(req, req.device_len)
        out.new_token_ids, out.text_delta = ids, text
        return out


def create_speculative_worker(args, engine) -> SpeculativeWorker | None:
    """The worker ServerArgs ask for (None: speculation off). STANDALONE loads its draft model."""
    if args.speculative_algorithm is None:
        return None
    draft = None
    if args.speculative_algorithm == "STANDALONE":
        from .standalone import DraftWorker
        draft = DraftWorker(args, engine)
    return SpeculativeWorker(args.speculative_algorithm, args.speculative_num_draft_tokens, draft)
