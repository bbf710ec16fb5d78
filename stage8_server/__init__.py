"""Stage 8 — the server: an OpenAI-compatible HTTP service in front of the engine (python -m
stage8_server)."""

from .core import Batch, Req, ReqStatus, SamplingParams
from .distributed import TPError
from .llm import LLM, GenerateResult, StreamChunk
from .models import UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerConfig
from .weights import CheckpointError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "StreamChunk", "Req", "ReqStatus", "Batch",
           "UnsupportedModelError", "CheckpointError", "Tokenizer", "TokenizerConfig", "TPError"]
