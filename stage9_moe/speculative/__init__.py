"""Speculative decoding (SGLang's --speculative-algorithm): guess k tokens cheaply, check them all
in one forward pass of the target model, keep the longest correct prefix plus the target's own next
token.

    ngram.py       NGRAM: drafts copied from the request's own prompt and output (no second model)
    standalone.py  STANDALONE: a small draft model with the same vocabulary, and its own KV cache
    verify.py      the accept rules: greedy (longest prefix) and sampled (rejection sampling)
    worker.py      one verify step of the scheduler: drafts -> extend over k + 1 tokens -> accept ->
                   give back the rejected drafts' KV pages
"""

from .verify import accept_draft, accept_sampled
from .worker import SPECULATIVE_ALGORITHMS, SpeculativeWorker, create_speculative_worker

__all__ = ["SPECULATIVE_ALGORITHMS", "SpeculativeWorker", "accept_draft", "accept_sampled",
           "create_speculative_worker"]
