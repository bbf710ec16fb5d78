"""Text <-> token ids, and the settings around it that an engine must get right, in one config
object.

The tokenizer itself (BPE merges, normalisation) is Hugging Face's `tokenizers` via
transformers.AutoTokenizer: what this module owns is the policy.

- EOS ids. When does generation stop? Checkpoints say it in up to three places, and they disagree:
  config.json (`eos_token_id`: 128001), generation_config.json (`eos_token_id`: [128001, 128008,
  128009] for Llama-3.1 Instruct: end of text, end of message, end of turn) and the tokenizer's
  eos_token. Stopping on only one of them is the classic bug of a chat model that never stops
  talking; we stop on their union.
- Chat template: the jinja template shipped with the tokenizer turns a list of messages into the
  exact text the model was fine-tuned on (role markers, generation prompt).
- Special tokens: plain text is encoded without adding BOS by default, since chat templates write
  their own (adding it again would double it). Set add_special_tokens=True for base models that
  expect a BOS.
- Length: a prompt longer than max_length is refused by default; with truncation=True it is cut on
  truncation_side ("left" keeps the end of the prompt, where the question usually is).
- Padding: our engine packs a batch and never pads; `pad()` exists for peers that do (transformers'
  generate), with padding_side "left" so that every row's last position holds a real token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Union

# a user message, or [{"role": "system"|"user"|"assistant", "content": ...}]
Messages = Union[str, list[dict]]


@dataclass
class TokenizerConfig:
    # longest prompt accepted; None: the model's context minus one (LLM fills it)
    max_length: int | None = None
    truncation: bool = False  # a longer prompt: refused (False) or cut to max_length (True)
    truncation_side: str = "left"
    padding_side: str = "left"
    add_special_tokens: bool = False
    # Read from the checkpoint when left empty:
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    # extra stop ids; the checkpoint's are added to them
    eos_token_ids: set[int] = field(default_factory=set)
    chat_template: str | None = None

    def validate(self) -> None:
        for name in ("truncation_side", "padding_side"):
            if getattr(self, name) not in ("left", "right"):
                raise ValueError(f"{name} must be 'left' or 'right', got {getattr(self, name)!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")


def read_eos_token_ids(model_path: Path, hf_config: dict | None = None) -> set[int]:
    """EOS may be one id or a list, in config.json and/or generation_config.json: take them all."""
    model_path = Path(model_path)
    sources = [
        hf_config if hf_config is not None else json.loads((model_path / "config.json").read_text())
    ]
    gen_file = model_path / "generation_config.json"
    if gen_file.exists():
        sources.append(json.loads(gen_file.read_text()))
    ids: set[int] = set()
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


# what AutoTokenizer can build from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_tokenizer_files(model_path: Path) -> None:
    """A checkpoint folder without any tokenizer file (a random-weight model built from a config,
    say) is refused here with its name, not by a puzzling error from deep inside transformers."""
    if not any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {model_path} (none of {', '.join(TOKENIZER_FILES)}): copy in the "
            "tokenizer files of the model's family")


class Tokenizer:
    def __init__(self, model_path: str | Path, config: TokenizerConfig | None = None):
        # imported here: importing the package stays light
        from transformers import AutoTokenizer

        # A copy: the fields filled in below are this checkpoint's, and the caller may reuse its
        # config elsewhere.
        self.config = config = replace(config) if config is not None else TokenizerConfig()
        config.validate()
        check_tokenizer_files(Path(model_path))
        self.hf = AutoTokenizer.from_pretrained(str(model_path))
        for name in ("bos_token", "eos_token", "pad_token"):  # fill what the caller left empty
            if getattr(config, name) is None:
                setattr(config, name, getattr(self.hf, name))
        if config.chat_template is None:
            config.chat_template = self.hf.chat_template
        config.eos_token_ids = set(config.eos_token_ids) | read_eos_token_ids(Path(model_path))
        if config.eos_token is not None:
            config.eos_token_ids.add(self.hf.convert_tokens_to_ids(config.eos_token))

    @property
    def eos_token_ids(self) -> set[int]:
        return self.config.eos_token_ids

    @property
    def pad_token_id(self) -> int:
        """The pad token, else the first EOS id (what transformers' generate falls back to)."""
        if self.config.pad_token is not None:
            return self.hf.convert_tokens_to_ids(self.config.pad_token)
        return min(self.eos_token_ids) if self.eos_token_ids else 0

    def encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is empty: nothing to continue from")
        return self.truncate(self.hf.encode(text,
                                            add_special_tokens=self.config.add_special_tokens))

    def truncate(self, ids: list[int]) -> list[int]:
        """Cut to max_length on truncation_side when truncation is on; else unchanged (the engine
        refuses a prompt that leaves no room to generate, naming its length)."""
        limit = self.config.max_length
        if not self.config.truncation or limit is None or len(ids) <= limit:
            return ids
        return ids[-limit:] if self.config.truncation_side == "left" else ids[:limit]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Messages,
                            add_generation_prompt: bool = True) -> list[int]:
        """Messages -> the token ids of the prompt as the model was fine-tuned to read it."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.config.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (a base model?): pass plain text instead")
        text = self.hf.apply_chat_template(messages, chat_template=self.config.chat_template,
                                           tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        # The template already wrote every special token it wants: never add BOS again.
        return self.truncate(self.hf.encode(text, add_special_tokens=False))

    def pad(self, batch: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """(padded ids, attention mask) for engines that pad, on padding_side."""
        width = max(map(len, batch))
        ids, mask = [], []
        for row in batch:
            pad = width - len(row)
            left = self.config.padding_side == "left"
            ids.append([self.pad_token_id] * pad + row if left else row + [self.pad_token_id] * pad)
            mask.append([0] * pad + [1] * len(row) if left else [1] * len(row) + [0] * pad)
        return ids, mask
