"""The data types every stage shares: what the user asks for (SamplingParams) and one request's
state (Req).

The names follow SGLang / mini-sglang so that a learner can move on to their source:

    input_ids + output_ids             all tokens the request knows on the host
    cached_len                         how many of them already have K/V in the KV cache
    device_len                         how many of them the next forward pass will have seen
    extend_len = device_len - cached_len   how many tokens the next forward pass feeds in
    max_device_len                     prompt length + max_new_tokens: the most the request can ever
                                       hold

Stage 4 adds the request's life in a scheduler: WAITING (queued, or preempted and queued again) ->
RUNNING (holds KV pages and a page-table row) -> FINISHED, with a finish reason. A chunked prefill
feeds the prompt in pieces: device_len stops short of the prompt's end until the last chunk.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Below this temperature a request is greedy (SGLang's epsilon): logits / 1e-300 would overflow.
GREEDY_TEMPERATURE = 1e-6
# torch.Generator.manual_seed takes any 64-bit value; past it, it raises in the middle of a step.
SEED_LIMIT = 2**64
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (SGLang's names and meanings).

    temperature == 0 (the default here, as in mini-sglang; SGLang's server defaults to 1.0) means
    greedy, and so does any temperature below GREEDY_TEMPERATURE.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    min_p: float = 0.0  # drop tokens whose probability is below min_p * p(most likely token)
    # >1 discourages tokens already in prompt or output (divides positive logits)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # subtract count(token in output) * frequency_penalty
    presence_penalty: float = 0.0  # subtract presence_penalty once a token appeared in the output
    ignore_eos: bool = False
    # stop strings: generation ends when the text contains one (trimmed)
    stop: str | list[str] | None = None
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
        for name in FLOAT_FIELDS:  # NaN passes every comparison below: refuse it by name
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and
                                          not isinstance(self.seed, bool) and
                                          0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and not (isinstance(stops, list) and
                                      all(isinstance(s, str) and s for s in stops)):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def is_greedy(self) -> bool:
        # The fast path: argmax needs no softmax, no sorting and no random numbers.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue: no KV pages held
    RUNNING = "running"  # holds a page-table row and KV pages
    FINISHED = "finished"


@dataclass
class Req:
    """One request's state on the host. The scheduler moves it forward one forward pass at a
    time."""

    rid: int
    input_ids: list[int]  # the prompt
    sampling_params: SamplingParams
    priority: int = 0  # higher runs first; FCFS within a level
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    device_len: int = 0
    status: ReqStatus = ReqStatus.WAITING
    # "stop" (EOS, stop token or stop string), "length", or "abort"
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended the request
    table_idx: int = -1  # this request's row in the page table while RUNNING
    arrival: int = 0  # scheduler step at which the request arrived (FCFS order, ageing)
    num_preemptions: int = 0
    # Stage 6, the prefix cache: what the radix tree held of this request's tokens when it was
    # (last) admitted.
    prefix_indices: object = None  # [matched] int64 KV slots of the matched prefix (a torch tensor)
    # the tree node where the match ended: locked while the request holds its row
    last_node: object = None
    # prompt tokens served from the cache at its first admission (not computed)
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        # A new request has nothing cached and feeds its whole prompt in the first forward
        # (prefill).
        self.device_len = len(self.input_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

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

    def set_chunk(self, chunk_len: int) -> None:
        """Feed only the next chunk_len uncached tokens in the next pass (chunked prefill)."""
        self.device_len = self.cached_len + chunk_len

    def complete_chunk(self) -> None:
        """A non-final prefill chunk ran: its tokens are cached, and no token is sampled."""
        self.cached_len = self.device_len

    def complete_one(self, token_id: int) -> None:
        """Record one forward pass: its inputs are now cached, and the sampled token becomes the
        next input."""
        self.cached_len = self.device_len
        self.output_ids.append(token_id)
        self.device_len += 1

    def reset_for_recompute(self) -> None:
        """Preempted: its pages were given back (the full ones to the prefix cache, from stage 6),
        so everything known (prompt + output so far) is prefilled again, from whatever of it the
        cache still holds then."""
        self.cached_len = 0
        self.device_len = len(self.all_ids)
        self.status = ReqStatus.WAITING
        self.table_idx = -1
        self.num_preemptions += 1

    def check_invariants(self) -> None:
        assert 0 <= self.cached_len <= self.device_len <= len(self.all_ids), self
        assert self.device_len <= self.max_device_len, self
        assert len(self.output_ids) <= self.sampling_params.max_new_tokens, self


@dataclass
class Batch:
    """The requests of one forward pass. Prefill feeds prompts (or chunks of them); decode feeds one
    token each."""

    reqs: list[Req]
    phase: str  # "prefill" or "decode"
    # the KV pool slot of every new token, in order
    out_cache_loc: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.reqs)
