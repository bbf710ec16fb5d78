"""Stage 9 — mixture of experts (Qwen3-MoE, Mixtral): a router, stacked experts, a fused MoE
kernel."""

from .core import Batch, Req, ReqStatus, SamplingParams
from .distributed import TPError
from .llm import LLM, GenerateResult, StreamChunk
from .models import UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerConfig
from .weights import CheckpointError

__all__ = ["LLM", "SamplingParams", "GenerateResult", "StreamChunk", "Req", "ReqStatus", "Batch",
           "UnsupportedModelError", "CheckpointError", "Tokenizer", "TokenizerConfig", "TPError"]
