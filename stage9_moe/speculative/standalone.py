"""STANDALONE drafts: a small model with the target's vocabulary guesses the next k tokens, one
decode step each, greedily (its argmax: a deterministic draft, accepted by verify.py's rule).

The draft model is a second Engine with its own KV pool and page table, and its own view of each
request: the tokens its KV cache holds (`cached_len` of a draft-side Req). Before drafting it
catches up in one extend over what it has not seen (a new prompt, or the tokens accepted last step),
then decodes k - 1 times:

    target all_ids:  p0 .. pL-1                  draft cached: p0 .. pc-1
    draft extend:    pc .. pL-1      -> d1       (its logits at the last position)
    draft decode:    d1 -> d2, ..., d(k-1) -> dk

After the verify pass its cache is cut back to the prefix it shares with the target's tokens (the
rejected drafts' K/V are simply overwritten later): no copy, no second radix tree. A request the
target no longer runs (finished, preempted) gives its draft pages back.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core import Batch, Req, SamplingParams
from ..engine import Engine
from ..scheduler.cache_manager import CacheManager


def check_draft_vocab(draft_path: Path, target_vocab: int) -> None:
    """The draft must speak the target's token ids: refuse another vocabulary by name."""
    vocab = json.loads((Path(draft_path) / "config.json").read_text()).get("vocab_size")
    if vocab != target_vocab:
        raise ValueError(f"speculative_draft_model_path {str(draft_path)!r} has a vocabulary of "
                         f"{vocab} tokens, the target model {target_vocab}: a STANDALONE draft "
                         "must use the target's tokenizer")


class DraftWorker:
    def __init__(self, args, target: Engine):
        from ..llm import resolve_model_path  # llm.py imports the scheduler, which imports us

        path = resolve_model_path(args.speculative_draft_model_path)
        check_draft_vocab(path, target.config.vocab_size)
        rows = target.page_table.max_rows
        # as many tokens as the target's pool, plus every row's drafts
        tokens = (target.kv_pool.num_pages + rows) * target.kv_pool.page_size + \
            rows * args.speculative_num_draft_tokens
        self.engine = Engine(path, device=target.device, dtype=target.dtype,
                             attention_backend=args.attention_backend,
                             page_size=target.kv_pool.page_size, max_running_requests=rows,
                             max_total_tokens=tokens, eos_token_ids=target.eos_token_ids,
                             verbose=False, cuda_graph=not args.disable_cuda_graph,
                             cuda_graph_max_bs=args.cuda_graph_max_bs)
        self.cache = CacheManager(self.engine.kv_pool, self.engine.page_table)  # no radix tree
        self.reqs: dict[int, Req] = {}  # rid -> the draft's view: input_ids = the tokens it fed

    def release_gone(self, running: list[Req]) -> None:
        """Requests the target no longer runs give their draft pages and row back."""
        alive = {r.rid for r in running}
        for rid in [rid for rid in self.reqs if rid not in alive]:
            self.cache.release(self.reqs.pop(rid), cache_pages=False)

    def sync(self, req: Req) -> Req | None:
        """The draft-side request of req, its cache cut back to the prefix it shares with req's
        tokens; its next extend feeds the rest."""
        tokens = req.all_ids
        dreq = self.reqs.get(req.rid)
        if dreq is None:
            dreq = Req(req.rid, list(tokens), SamplingParams(max_new_tokens=1))
            self.cache.match_prefix(dreq)  # no tree: an empty prefix
            if not self.cache.can_run():
                return None
            self.cache.acquire_row(dreq)
            self.reqs[req.rid] = dreq
        shared = 0
        for a, b in zip(dreq.input_ids[: dreq.cached_len], tokens):
            if a != b:
                break
            shared += 1
        dreq.input_ids = list(tokens)
        dreq.cached_len = min(shared, len(tokens) - 1)  # the last token is fed again: its logits
        dreq.device_len = len(tokens)
        return dreq

    def propose(self, reqs: list[Req], limits: list[int], running: list[Req]) -> list[list[int]]:
        """Up to limits[i] greedy draft tokens for each request."""
        self.release_gone(running)
        drafts: list[list[int]] = [[] for _ in reqs]
        limits = list(limits)
        active = []  # (index, draft-side request)
        for i, (req, k) in enumerate(zip(reqs, limits)):
            # the draft's own context may be shorter than the target's
            k = min(k, self.engine.max_context_len - len(req.all_ids) + 1)
            limits[i] = k
            dreq = self.sync(req) if k > 0 else None
            # pages for the tokens it will feed: up to d(k-1)
            if dreq is not None and self.cache.grow(dreq, len(req.all_ids) + k - 1):
                active.append((i, dreq))
        phase = "prefill"  # the catch-up extend first, then one-token decodes
        while active:
            batch = [d for _, d in active]
            slots = [s for d in batch for s in self.cache.slots(d, d.cached_len, d.device_len)]
            tokens = self.engine.forward(Batch(batch, phase, slots)).argmax(dim=-1).tolist()
            phase, still = "decode", []
            for (i, dreq), token in zip(active, tokens):
                drafts[i].append(token)
                dreq.cached_len = dreq.device_len
                if len(drafts[i]) < limits[i]:  # feed it to get the next one
                    dreq.input_ids.append(token)
                    dreq.device_len += 1
                    still.append((i, dreq))
            active = still
        return drafts
