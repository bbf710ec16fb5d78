"""Stage 1 — a naive engine: one request at a time, prefill then decode with a KV cache, greedy."""

from .core import Req, SamplingParams
from .llm import LLM, GenerateResult
from .model import UnsupportedModelError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "Req", "UnsupportedModelError"]
