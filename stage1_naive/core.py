"""The two data types every stage shares: what the user asks for (SamplingParams) and one request's
state (Req).

The names follow SGLang / mini-sglang so that a learner can move on to their source:

    input_ids + output_ids             all tokens the request knows on the host
    cached_len                         how many of them already have K/V in the KV cache
    device_len                         how many of them the next forward pass will have seen
    extend_len = device_len - cached_len   how many tokens the next forward pass feeds in
    max_device_len                     prompt length + max_new_tokens: the most the request can ever
                                       hold

Life of a request with a 5-token prompt and max_new_tokens=3:

    new              cached_len=0  device_len=5   extend_len=5   (prefill feeds the whole prompt)
    after prefill    cached_len=5  device_len=6   extend_len=1   (one sampled token waits to be fed)
    after decode 1   cached_len=6  device_len=7   extend_len=1
    after decode 2   finished: 3 tokens generated (the last one never needs its K/V)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 (the default here, as in mini-sglang; SGLang's server defaults to 1.0) means
    greedy.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request random seed for sampling

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field; called at construction and again when a request is
        added."""
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        # The fast path: argmax needs no softmax, no sorting and no random numbers.
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class Req:
    """One request's state on the host. The engine moves it forward one forward pass at a time."""

    rid: int
    input_ids: list[int]  # the prompt
    sampling_params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    device_len: int = 0
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS / stop token) or "length"

    def __post_init__(self) -> None:
        # A new request has nothing cached and feeds its whole prompt in the first forward
        # (prefill).
        self.device_len = len(self.input_ids)

    @property
    def max_device_len(self) -> int:
        return len(self.input_ids) + self.sampling_params.max_new_tokens

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def next_input_ids(self) -> list[int]:
        """The tokens the next forward pass must feed: those seen by the host but not yet in the KV
        cache."""
        return self.all_ids[self.cached_len : self.device_len]

    def complete_one(self, token_id: int) -> None:
        """Record one forward pass: its inputs are now cached, and the sampled token becomes the
        next input."""
        self.cached_len = self.device_len
        self.output_ids.append(token_id)
        self.device_len += 1

    def check_invariants(self) -> None:
        assert 0 <= self.cached_len <= self.device_len <= len(self.all_ids), self
        assert self.device_len <= self.max_device_len, self
        assert len(self.output_ids) <= self.sampling_params.max_new_tokens, self
