"""What the server's processes say to each other over ZMQ: typed messages (SGLang's io_struct
names).

    API server ──GenerateReqInput, AbortReq, ControlReq──▶ tokenizer worker
    tokenizer worker ──BatchTokenizedGenerateReqInput, AbortReq, ControlReq──▶ scheduler
    tokenizer worker ──BatchStrOut (a request it refused)──▶ API server
    scheduler ──BatchTokenIDOut (token ids, one message per step)──▶ detokenizer
    detokenizer ──BatchStrOut (text deltas)──▶ API server
    scheduler ──ControlOut (status, flush_cache)──▶ API server

Every socket is a PUSH/PULL pair: the receiver binds an ipc:// path, senders connect. ZMQ keeps each
sender's messages in order, which the server relies on: an abort travels the same road as its
request (API server -> tokenizer -> scheduler), so it can never overtake it.

Serialisation is pickle (pyzmq's send_pyobj / recv_pyobj), as SGLang does. Every peer is one of our
own processes running the same code, so pickle carries these dataclasses, SamplingParams included,
with no schema to keep in step; msgpack would need a to-dict / from-dict pair for each type for no
gain at this size. Pickle runs code while it loads, so it must never read bytes from anyone else:
the sockets are ipc:// files in a private directory (mode 0700), never a TCP port.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from ..core import SamplingParams


@dataclass
class PortArgs:
    """The ipc addresses, one per receiving process (SGLang's PortArgs)."""

    api_ipc_name: str  # the API server's inbox: text outputs, refusals, control replies
    tokenizer_ipc_name: str  # the tokenizer worker's inbox
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str

    @staticmethod
    def new() -> "PortArgs":
        # mode 0700: only this user can connect; named after the launcher's pid, for people
        folder = tempfile.mkdtemp(prefix=f"sglz-{os.getpid()}-")
        return PortArgs(*(f"ipc://{os.path.join(folder, name)}"
                          for name in ("api", "tokenizer", "scheduler", "detokenizer")))


@dataclass
class EngineInfo:
    """What the scheduler process reports once its engine is loaded; the tokenizer worker validates
    against it."""

    max_context_len: int
    vocab_size: int
    max_total_tokens: int  # KV pool capacity
    page_size: int


# ---------------------------------------------------------------- requests
@dataclass
class GenerateReqInput:
    """One prompt from the API server, for n copies (parallel sampling): rids has one id per
    copy."""

    rids: list[int]
    sampling_params: dict  # SamplingParams field names; max_new_tokens None: up to the context
    text: str | None = None  # exactly one of text / input_ids / messages
    input_ids: list[int] | None = None
    # chat: the tokenizer worker applies the model's chat template
    messages: list[dict] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: the prompt's logprobs too, from this token on (see Req)
    echo: bool = False  # completions' echo: the first output carries the prompt's text


@dataclass
class TokenizedGenerateReqInput:
    """A validated request, ready to become the scheduler's Req."""

    rid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    prompt_text: str | None = None  # echo: the prompt as text (token ids decoded), for output 1


@dataclass
class BatchTokenizedGenerateReqInput:
    """The copies of one prompt (n > 1): the scheduler admits the first one step before the others,
    so that they find its prompt in the radix cache instead of computing it again."""

    reqs: list[TokenizedGenerateReqInput]


@dataclass
class AbortReq:
    rid: int


@dataclass
class ControlReq:
    """A question for the scheduler: "status" (counts, pages, cache) or "flush_cache".
    check_integrity: also walk every page and the whole radix tree (CacheManager.check_integrity),
    which stalls the scheduler's loop for as long."""

    req_id: int
    kind: str
    check_integrity: bool = False


@dataclass
class ControlOut:
    req_id: int
    result: dict


# ---------------------------------------------------------------- outputs
@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the prompt's first token, which nothing before it scores
    # the most likely tokens at this step: (token id, logprob), best first
    top: list[tuple[int, float]]
    text: str = ""  # filled in by the detokenizer, as are the texts of the top tokens
    top_texts: list[str] = field(default_factory=list)


@dataclass
class ReqOutput:
    """One request's news from one step. The scheduler fills the token fields, the detokenizer the
    text."""

    rid: int
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # "stop", "length", "abort", or "error" (then `error` says why)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    input_logprobs: list[TokenLogprob] | None = None  # with the 1st output: the prompt's, if asked
    prompt_text: str | None = None  # with the first output of an echo request
    # sent with a request's first output: the detokenizer needs them
    stop_strings: list[str] | None = None
    text: str = ""  # the text delta: complete characters only, never part of a stop string
    error: str | None = None
    error_code: str | None = None  # OpenAI's error code, e.g. "context_length_exceeded"


@dataclass
class BatchTokenIDOut:
    outputs: list[ReqOutput]


@dataclass
class BatchStrOut:
    outputs: list[ReqOutput]


def error_output(rid: int, message: str, code: str | None = "invalid_value") -> ReqOutput:
    return ReqOutput(rid, finished=True, finish_reason="error", error=message, error_code=code)
