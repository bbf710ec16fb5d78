"""The tokenizer worker: text in, validated token ids out, in a process of its own.

    API server ──GenerateReqInput──▶ [chat template, tokenize, validate]
                                      ├── TokenizedGenerateReqInput ──▶ scheduler
                                      └── a refusal (BatchStrOut with an error) ──▶ API server

Everything the engine would refuse is refused here, before the scheduler sees it, with a message
naming the field: the sampling parameters (SamplingParams.validate; a grammar's size and depth), the
prompt's token ids (ints inside the vocabulary), the length (prompt + max_new_tokens must fit the
context, and the KV pool). A request without max_new_tokens gets all that is left of the smaller of
the two (SGLang's max_req_len, less the prompt). A bad request costs the scheduler nothing, and an
exception while handling one request (a chat template that raises, say) is reported for that request
alone: the worker keeps serving.

Aborts and control requests go through here unchanged, on the same socket as the requests, so they
reach the scheduler in the order the API server sent them.

SGLang does this work inside the API server process (its TokenizerManager). A process of its own
keeps a long prompt's tokenization, or a chat template's Jinja, off the event loop that serves every
HTTP client.
"""

from __future__ import annotations

import dataclasses
import logging

from ..constrained import check_grammar
from ..core import SEED_LIMIT, SamplingParams
from ..tokenizer import Tokenizer
from .messages import (AbortReq, BatchStrOut, BatchTokenizedGenerateReqInput, ControlReq,
                       EngineInfo, GenerateReqInput, PortArgs, TokenizedGenerateReqInput,
                       error_output)
from .process import POLL_TIMEOUT_MS, ChildProcess, open_sockets

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class RequestError(ValueError):
    def __init__(self, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.code = code


class TokenizerWorker:
    def __init__(self, tokenizer: Tokenizer, info: EngineInfo):
        self.tokenizer, self.info = tokenizer, info

    def tokenize(self, req: GenerateReqInput) -> BatchTokenizedGenerateReqInput:
        """One prompt -> its n validated copies. Raises RequestError naming the problem."""
        input_ids = self.prompt_ids(req)
        # Prompt + generated tokens fit the context and the whole KV pool (SGLang's max_req_len).
        max_req_len = min(self.info.max_context_len, self.info.max_total_tokens)
        prompt_len, limit = len(input_ids), self.length_limit()
        if prompt_len >= max_req_len:
            raise RequestError(f"{limit}; the prompt has {prompt_len}, leaving no room to "
                               "generate.", "context_length_exceeded")
        params = dict(req.sampling_params)
        unknown = sorted(set(params) - SAMPLING_FIELDS)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if params.get("max_new_tokens") is None:  # OpenAI's default for chat: all the request gets
            params["max_new_tokens"] = max_req_len - prompt_len
        try:
            base = SamplingParams(**params)
            # Size, depth and JSON syntax only: xgrammar's parse runs with the compile, on the
            # scheduler's grammar threads and under its time limit, never on this one thread that
            # every request waits for. A grammar that does not parse is a 400 from there.
            check_grammar(base, parse=False)
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc)) from None
        if prompt_len + base.max_new_tokens > max_req_len:
            raise RequestError(f"{limit}; the prompt has {prompt_len} and max_tokens asks for "
                               f"{base.max_new_tokens} more: max_tokens may be at most "
                               f"{max_req_len - prompt_len} for this prompt.",
                               "context_length_exceeded")
        start = req.logprob_start_len
        if not (isinstance(start, int) and not isinstance(start, bool)
                and -1 <= start < prompt_len):
            raise RequestError(f"logprob_start_len must be -1 (none) or a prompt position in "
                               f"[0, {prompt_len}), got {start!r}")
        bad = [t for t in base.stop_token_ids if t >= self.info.vocab_size]
        if bad:
            raise RequestError(
                f"stop_token_ids must be < the vocabulary size {self.info.vocab_size}, got {bad}")
        if not isinstance(req.return_logprob, bool):
            raise RequestError(f"return_logprob must be a bool, got {req.return_logprob!r}")
        k = req.top_logprobs_num
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_TOP_LOGPROBS):
            raise RequestError(
                f"top_logprobs_num must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if base.seed is not None and base.seed + len(req.rids) > SEED_LIMIT:
            raise RequestError(f"seed must be at most 2**64 - n = {SEED_LIMIT - len(req.rids)} "
                               f"with n = {len(req.rids)} (copy i samples with seed + i), got "
                               f"{base.seed}")
        copies = []
        for i, rid in enumerate(req.rids):
            # Copies of a seeded request differ from each other, and each is reproducible: copy i
            # uses seed + i.
            seed = None if base.seed is None else base.seed + i
            params_i = dataclasses.replace(base, seed=seed,
                                           stop_token_ids=list(base.stop_token_ids))
            prompt_text = self.prompt_text(req, input_ids) if req.echo else None
            copies.append(TokenizedGenerateReqInput(rid, input_ids, params_i, req.return_logprob, k,
                                                    start, prompt_text))
        return BatchTokenizedGenerateReqInput(copies)

    def length_limit(self) -> str:
        ctx, pool = self.info.max_context_len, self.info.max_total_tokens
        if ctx <= pool:
            return f"This model's maximum context length is {ctx} tokens"
        return f"The KV cache holds {pool} tokens (--max-total-tokens), less than the context {ctx}"

    def prompt_text(self, req: GenerateReqInput, input_ids: list[int]) -> str:
        """What echo puts first: the prompt as sent, or its token ids decoded (OpenAI's, vLLM's)."""
        if req.text is not None:
            return req.text
        return self.tokenizer.decode(input_ids, skip_special_tokens=False)

    def prompt_ids(self, req: GenerateReqInput) -> list[int]:
        given = [
            name for name in ("text", "input_ids", "messages") if getattr(req, name) is not None
        ]
        if len(given) != 1:
            raise RequestError(
                f"give exactly one of text, input_ids, messages (got {given or 'none'})")
        if req.messages is not None:
            return self.chat_ids(req.messages)
        if req.text is not None:
            if not isinstance(req.text, str) or not req.text:
                raise RequestError("prompt is empty: nothing to continue from")
            return self.tokenizer.encode(req.text)
        ids = req.input_ids
        if not isinstance(ids, list) or not ids:
            raise RequestError("prompt token list is empty: nothing to continue from")
        vocab = self.info.vocab_size
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return list(ids)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and
                    isinstance(m.get("content"), str)):
                raise RequestError(f"messages[{i}] must have a string role and string content")
        try:
            return self.tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        except Exception as exc:  # the template's Jinja raised (e.g. roles it does not accept)
            raise RequestError(f"the chat template refused these messages: {exc}") from None


def run_tokenizer_worker(model_path: str, info: EngineInfo, ports: PortArgs, ready_conn) -> None:
    """Entry point of the tokenizer worker process."""
    child = ChildProcess("tokenizer worker", ready_conn)
    try:
        # The scheduler's tokenizer has max_length filled in the same way (LLM): the check is ours,
        # above.
        worker = TokenizerWorker(Tokenizer(model_path), info)
        recv, to_scheduler, to_api = open_sockets(
            ports.tokenizer_ipc_name, ports.scheduler_input_ipc_name, ports.api_ipc_name)
    except Exception:
        child.failed()
    child.ready()
    while child.parent_alive():
        if not recv.poll(POLL_TIMEOUT_MS):
            continue
        msg = recv.recv_pyobj()
        if isinstance(msg, GenerateReqInput):
            try:
                to_scheduler.send_pyobj(worker.tokenize(msg))
            except Exception as exc:  # this request alone fails; the worker goes on
                code = exc.code if isinstance(exc, RequestError) else "invalid_value"
                if not isinstance(exc, RequestError):
                    logger.exception("tokenizing request %s failed", msg.rids)
                to_api.send_pyobj(
                    BatchStrOut([error_output(rid, str(exc), code) for rid in msg.rids]))
        elif isinstance(msg, (AbortReq, ControlReq)):
            to_scheduler.send_pyobj(msg)
        else:
            logger.error("tokenizer worker: unexpected message %r", type(msg).__name__)
