"""Stage 5 — CUDA graphs for decode and an overlap scheduler: take the CPU out of the decode
loop."""

from .core import Batch, Req, ReqStatus, SamplingParams
from .llm import LLM, GenerateResult, StreamChunk
from .models import UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerConfig
from .weights import CheckpointError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "StreamChunk", "Req", "ReqStatus", "Batch",
           "UnsupportedModelError", "CheckpointError", "Tokenizer", "TokenizerConfig"]
