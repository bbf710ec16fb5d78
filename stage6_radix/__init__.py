"""Stage 6 — the radix-tree prefix cache: compute a shared prefix once, reuse its KV across
requests."""

from .core import Batch, Req, ReqStatus, SamplingParams
from .llm import LLM, GenerateResult, StreamChunk
from .models import UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerConfig
from .weights import CheckpointError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "StreamChunk", "Req", "ReqStatus", "Batch",
           "UnsupportedModelError", "CheckpointError", "Tokenizer", "TokenizerConfig"]
