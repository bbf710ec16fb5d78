"""Stage 3 — model layers and weight loading: Llama / Qwen2 / Qwen3 / Mistral checkpoints, merged
linears, a streaming safetensors loader, a tokenizer config."""

from .core import Batch, Req, SamplingParams
from .llm import LLM, GenerateResult
from .models import UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerConfig
from .weights import CheckpointError

__all__ = [
    "LLM", "SamplingParams", "GenerateResult", "Req", "Batch", "UnsupportedModelError",
    "CheckpointError", "Tokenizer", "TokenizerConfig"
]
