"""Stage 4's first admission rule, kept for comparison with the look-ahead that replaced it.

    without_look_ahead(llm)   the LLM's PrefillAdder keeps one page back per running request and charges a new
                              request only its prompt: no estimate of the tokens anyone will still generate

Used by the tests and notebooks of stages 4 and later to show what new_token_ratio buys on a tight pool (fewer
preemptions, less recompute, the same tokens), and to force preemptions where a test needs them.
"""

from __future__ import annotations


def without_look_ahead(llm):
    """Swap the scheduler's PrefillAdder for one without look-ahead (same class otherwise); returns the llm."""
    sched = llm.scheduler
    base = type(sched.prefill_adder)

    class PageReserveAdder(base):
        def reserved_pages(self, running, new_token_ratio, max_context_len):
            return len(running)  # one page per running request keeps decode moving, nothing more

        def future_tokens(self, req, max_context_len):
            return 0  # a new request is charged its prompt only

    sched.prefill_adder = PageReserveAdder(sched.cache, sched.max_prefill_tokens, sched.chunked_prefill_size)
    return llm
