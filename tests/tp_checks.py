"""Shared by the tensor-parallel tests of stages 7, 8 and 9: a control-operation workload whose outcome depends on
the order of its operations, and faults injected into one spawned rank.

A spawned rank is a fresh interpreter: monkeypatching the test's process does not reach it. The fault functions
below are module-level, so the rank can import them by name; a test puts one in place of `tp_worker.run_follower`
(functools.partial(fault, stage, ...)), and the rank then runs the stage's real follower with the fault applied.
"""

from __future__ import annotations

import importlib


def flush_and_abort_in_one_turn(llm, params_cls) -> list[tuple[list[int], int]]:
    """A request decodes, then one turn holds a flush and its abort, in both orders; then a prompt with its prefix.
    -> (tokens, cached_tokens) of that prompt, flush-then-abort first. Flush first: the aborted request's full
    pages go into the emptied tree and the next prompt reuses them; abort first: the flush empties the tree again."""
    prefix = list(range(10, 60))  # 50 tokens: 3 full pages of 16
    results = []
    for order in ("flush, abort", "abort, flush"):
        rid = llm.add_request(prefix + [1, 2], params_cls(max_new_tokens=50, ignore_eos=True))
        for _ in range(3):  # prefill, then decode
            llm.step()
        for op in order.split(", "):
            llm.flush_cache() if op == "flush" else llm.abort_request(rid)
        (out,) = llm.generate([prefix + [3, 4]], params_cls(max_new_tokens=6, ignore_eos=True))
        results.append((out.token_ids, out.cached_tokens))
        llm.flush_cache()
        llm.step()
    return results


def follower_with_a_wrong_token(stage: str, at_call: int, rank: int, *args) -> None:
    """Stage `stage`'s run_follower, except that this rank's sampler adds one to the tokens of its at_call-th
    call: the rank then disagrees with the others about what it sampled."""
    launcher = importlib.import_module(f"{stage}.scheduler.run_batch")  # where the step samples
    sample, calls = launcher.sample_tensor, []

    def wrong_once(*a, **kw):
        tokens = sample(*a, **kw)
        calls.append(None)
        return tokens + 1 if len(calls) == at_call else tokens
    launcher.sample_tensor = wrong_once
    importlib.import_module(f"{stage}.tp_worker").run_follower(rank, *args)


def follower_that_raises(stage: str, at_step: int, rank: int, *args) -> None:
    """Stage `stage`'s run_follower, except that this rank's scheduler raises in its at_step-th step."""
    scheduler = importlib.import_module(f"{stage}.scheduler.scheduler")
    step = scheduler.Scheduler.step

    def failing_step(self):
        if self.step_count + 1 == at_step:
            raise RuntimeError(f"fault injected into rank {rank} at step {at_step}")
        return step(self)
    scheduler.Scheduler.step = failing_step
    importlib.import_module(f"{stage}.tp_worker").run_follower(rank, *args)
