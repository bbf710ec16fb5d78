"""Stage 4 — a complete engine: paged KV cache, continuous batching scheduler, chunked prefill,
preemption, full sampling, stop strings, incremental detokenization and streaming."""

from .core import Batch, Req, ReqStatus, SamplingParams
from .llm import LLM, GenerateResult, StreamChunk
from .models import UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerConfig
from .weights import CheckpointError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "StreamChunk", "Req", "ReqStatus", "Batch",
           "UnsupportedModelError", "CheckpointError", "Tokenizer", "TokenizerConfig"]
