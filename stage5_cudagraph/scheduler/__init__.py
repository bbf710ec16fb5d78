"""The scheduler: waiting queue -> prefill batches (PrefillAdder) -> decode batches (DecodeManager),
    with KV pages
handed out by the CacheManager."""

from .cache_manager import CacheManager
from .decode import DecodeManager
from .metrics import StepStats
from .output_processor import StepOutput
from .prefill import PrefillAdder
from .scheduler import Scheduler

__all__ = ["CacheManager", "DecodeManager", "PrefillAdder", "Scheduler", "StepOutput", "StepStats"]
