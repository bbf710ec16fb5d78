"""Stage 2 — static batching: many requests share each forward pass; packed varlen prefill;
attention backends."""

from .core import Batch, Req, SamplingParams
from .llm import LLM, GenerateResult
from .model import UnsupportedModelError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "Req", "Batch", "UnsupportedModelError"]
