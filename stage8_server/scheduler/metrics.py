"""What the scheduler reports about itself (SGLang: scheduler_metrics_mixin.py): StepStats, the
record of one step (kept when record_stats is set), and the throughput line logged every
log_interval decode steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import Batch

if TYPE_CHECKING:  # scheduler.py imports this module
    from .scheduler import Scheduler

logger = logging.getLogger(__name__.split(".")[0])


@dataclass
class StepStats:
    step: int
    phase: str
    batch_size: int
    num_tokens: int
    num_running: int
    num_waiting: int
    used_pages: int
    num_preempted: int
    seconds: float
    # stage 6: prompt tokens served from the tree / prompt tokens admitted, so far
    cache_hit_rate: float = 0.0
    tree_tokens: int = 0  # stage 6: tokens held by the radix tree


def log_decode_stats(scheduler: Scheduler, batch: Batch, num_new_tokens: int) -> None:
    """Count the step's new tokens; every log_interval-th decode step, log the throughput since
    the last line (its counters are the scheduler's _log_tokens and _log_time)."""
    scheduler._log_tokens += num_new_tokens
    if (
        scheduler.log_interval
        and batch.phase == "decode"
        and scheduler.step_count % scheduler.log_interval == 0
    ):
        now = time.perf_counter()
        logger.info(
            "step %d: decode batch %d, %d waiting, KV pages %d/%d used, cache hit rate %.1f%%, "
            "tree "
            "%d tokens, gen throughput %.1f tok/s",
            scheduler.step_count,
            batch.size,
            len(scheduler.waiting),
            scheduler.cache.num_used_pages,
            scheduler.cache.pool.num_pages,
            100 * scheduler.cache_hit_rate,
            scheduler.tree_tokens,
            scheduler._log_tokens / (now - scheduler._log_time),
        )
        scheduler._log_tokens, scheduler._log_time = 0, now
