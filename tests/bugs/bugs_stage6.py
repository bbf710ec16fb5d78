"""Stage 6's bug-hunt checks beyond tests/exercises/stage6.py."""

from __future__ import annotations

STAGE = "stage6_radix"


def test_finished_requests_leave_no_lock(stage, tiny_llama_path):
    llm = stage.LLM(str(tiny_llama_path), attention_backend="torch", max_total_tokens=512,
                    page_size=2, verbose=False)
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21], [30, 31, 32, 33, 34]]
    params = stage.SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.generate(prompts, params)
    llm.generate(prompts[:2], params)  # the second time, their prefixes come from the tree
    tree = llm.scheduler.cache.tree
    assert tree.protected_size == 0, "no request runs: no prefix may stay locked"
    assert tree.evictable_size == tree.total_size() > 0
    llm.scheduler.check_integrity()
