"""Response bodies: the engine's outputs -> OpenAI's chat.completion / text_completion objects
(whole, or as the chunks of a stream) and SGLang's /generate shape.

A builder collects each choice's outputs as they arrive. Streaming, every output becomes zero or
more chunks at once; otherwise the whole response is built at the end. Usage counts each prompt once
however many copies (n) it had (OpenAI's convention), and sums completion tokens over all choices;
cached_tokens counts the same prompts once, so it never exceeds prompt_tokens: what the radix cache
held of each prompt when its first copy arrived. (The other copies then take that prompt from the
cache too: GET /get_server_info counts those, in prompt_tokens_cached.)

A chat request with a tool_choice (protocol.ToolCallFormat) answers with message.tool_calls instead
of content, and finish_reason "tool_calls" once the grammar is complete. Streamed, a named
function's arguments go out as they are generated (OpenAI's deltas: the id and name first, then
pieces of the arguments); "required" output is a JSON array whose calls are known only at its end,
so they go out whole, in the last chunk before the finish.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace

from .messages import ReqOutput, TokenLogprob
from .protocol import ToolCallFormat


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    input_logprobs: list[TokenLogprob] = field(default_factory=list)  # the prompt's, when asked
    text_offset: int = 0  # completions' logprobs: where the next token's text starts
    offsets: list[int] = field(default_factory=list)  # completions' logprobs: each text_offset
    started: bool = False  # chat streaming: the chunk with the role was sent
    # a named call's id
    tool_call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ResponseBuilder:
    id_prefix = "cmpl"

    def __init__(self, model: str, num_choices: int, n: int = 1, include_usage: bool = False,
                 logprobs: bool = False, continuous_usage: bool = False):
        self.model, self.n, self.include_usage, self.want_logprobs = (
            model,
            n,
            include_usage,
            logprobs,
        )
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: usage per chunk
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(num_choices)]

    def add(self, index: int, out: ReqOutput) -> Choice:
        ch = self.choices[index]
        ch.text += out.text
        ch.token_ids += out.token_ids
        ch.logprobs += out.logprobs or []
        ch.input_logprobs += out.input_logprobs or []
        ch.prompt_tokens, ch.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.finished:
            ch.finish_reason, ch.matched_stop = out.finish_reason, out.matched_stop
        return ch

    def usage(self) -> dict:
        prompt = sum(c.prompt_tokens for c in self.choices[:: self.n])
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices[:: self.n])  # prompt_tokens' prompts
        return {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}
        }

    def chunk(self, choices: list[dict]) -> dict:
        body = {
            "id": self.id, "object": self.chunk_object, "created": self.created,
            "model": self.model, "choices": choices
        }
        if self.include_usage:  # OpenAI's shape: every chunk has the key, the last one the numbers
            body["usage"] = self.usage() if self.continuous_usage else None  # vLLM's: those so far
        return body

    def final_chunks(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [dict(self.chunk([]), usage=self.usage())]


class ChatBuilder(ResponseBuilder):
    id_prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def __init__(self, *args, tool_format: ToolCallFormat | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_format = tool_format

    def stream_chunks(self, index: int, out: ReqOutput) -> list[dict]:
        if self.tool_format is not None:
            return self.tool_chunks(index, out)
        ch = self.add(index, out)
        chunks = []
        if not ch.started:
            ch.started = True
            chunks.append(
                self.chunk([{
                    "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None
                }]))
        if out.text or (self.want_logprobs and out.logprobs):
            chunks.append(
                self.chunk([{
                    "index": index, "delta": {"content": out.text},
                    "logprobs": self.logprobs(out.logprobs), "finish_reason": None
                }]))
        if out.finished:
            chunks.append(
                self.chunk([{
                    "index": index, "delta": {}, "logprobs": None,
                    "finish_reason": ch.finish_reason, "matched_stop": ch.matched_stop
                }]))
        return chunks

    def logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        # noqa: E731
        entry = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {
            "content": [
                dict(entry(t.text, t.logprob),
                     top_logprobs=[entry(s, lp) for s, (_, lp) in zip(t.top_texts, t.top)])
                for t in logprobs or []
            ]
        }

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            calls = self.tool_calls(c) if self.tool_format is not None else None
            if calls is not None:
                message, finish_reason = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": calls,
                }, self.tool_finish_reason(c)
            choices.append({"index": i, "message": message, "logprobs": self.logprobs(c.logprobs),
                            "finish_reason": finish_reason, "matched_stop": c.matched_stop})
        return {
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": self.usage()
        }

    # ---------------------------------------------------------------- tool calls
    def tool_calls(self, ch: Choice) -> list[dict] | None:
        """The choice's output as OpenAI tool calls. A named function's arguments are the output
        itself (cut short by max_tokens, they are returned so, with finish_reason "length", as
        OpenAI does); "required" output is parsed, and is None (plain content) if it is not a
        complete JSON array."""
        if self.tool_format.name is not None:
            return [tool_call(ch.tool_call_id, self.tool_format.name, ch.text)]
        try:
            calls = json.loads(ch.text)
        except ValueError:
            return None
        return [tool_call(f"call_{uuid.uuid4().hex[:24]}", c["name"], json.dumps(c["parameters"]))
                for c in calls]

    @staticmethod
    def tool_finish_reason(ch: Choice) -> str | None:
        return "tool_calls" if ch.finish_reason == "stop" else ch.finish_reason

    def tool_chunks(self, index: int, out: ReqOutput) -> list[dict]:
        ch = self.add(index, out)
        delta = lambda d: self.chunk([{"index": index, "delta": d, "logprobs": None,  # noqa: E731
                                       "finish_reason": None}])
        named, chunks = self.tool_format.name is not None, []
        if not ch.started:
            ch.started = True
            first = {"role": "assistant", "content": None}
            if named:  # the id and name now, the arguments as they come
                first["tool_calls"] = [
                    dict(tool_call(ch.tool_call_id, self.tool_format.name, ""), index=0)
                ]
            chunks.append(delta(first))
        if named and out.text:
            chunks.append(delta({"tool_calls": [{"index": 0,
                                                 "function": {"arguments": out.text}}]}))
        if not out.finished:
            return chunks
        finish_reason = self.tool_finish_reason(ch)
        if not named:
            calls = self.tool_calls(ch)
            if calls is None:  # not a complete array (max_tokens): what there is, as content
                chunks.append(delta({"content": ch.text}))
                finish_reason = ch.finish_reason
            else:
                chunks.append(delta({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]
                                     }))
        chunks.append(
            self.chunk([{
                "index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                "matched_stop": ch.matched_stop
            }]))
        return chunks


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class CompletionBuilder(ResponseBuilder):
    """echo: each choice starts with its prompt's text and, with logprobs, the prompt's logprobs
    (the first one null). drop_output: max_tokens 0, the token the prefill sampled is left out."""

    id_prefix, chunk_object = "cmpl", "text_completion"

    def __init__(self, *args, echo: bool = False, drop_output: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo, self.drop_output = echo, drop_output

    def add(self, index: int, out: ReqOutput) -> Choice:
        if self.drop_output:  # all it asked for was generated: "length", whatever token was drawn
            out = replace(out, token_ids=[], text="", logprobs=None, matched_stop=None,
                          finish_reason="length" if out.finished else None)
        ch = self.choices[index]
        before, prompt = len(ch.logprobs), []
        if self.echo and out.prompt_text is not None:  # the choice's first output: prompt first
            prompt = out.input_logprobs or []
            out = replace(out, text=out.prompt_text + out.text,
                          logprobs=prompt + (out.logprobs or []))
        super().add(index, out)
        self.add_offsets(ch, ch.logprobs[before : before + len(prompt)])
        if self.echo and out.prompt_text is not None:
            ch.text_offset = len(out.prompt_text)  # generated tokens start right after the prompt
        self.add_offsets(ch, ch.logprobs[before + len(prompt) :])
        return ch

    @staticmethod
    def add_offsets(ch: Choice, entries: list[TokenLogprob]) -> None:
        for t in entries:
            ch.offsets.append(ch.text_offset)
            ch.text_offset += len(t.text)

    def stream_chunks(self, index: int, out: ReqOutput) -> list[dict]:
        ch = self.choices[index]
        text_before, logprobs_before = len(ch.text), len(ch.logprobs)
        self.add(index, out)
        text, new = ch.text[text_before:], slice(logprobs_before, len(ch.logprobs))
        if not (text or out.finished or (self.want_logprobs and ch.logprobs[new])):
            return []
        return [self.chunk([{"index": index, "text": text, "logprobs": self.logprobs(ch, new),
                             "finish_reason": ch.finish_reason if out.finished else None,
                             "matched_stop": ch.matched_stop if out.finished else None}])]

    def logprobs(self, ch: Choice, which: slice = slice(None)) -> dict | None:
        """The legacy shape: parallel lists, top_logprobs as {token text: logprob} (null for the
        prompt's first token, which nothing scores); text_offset: where each token's text starts in
        the choice's text."""
        if not self.want_logprobs:
            return None
        entries = ch.logprobs[which]
        return {"tokens": [t.text for t in entries], "token_logprobs": [t.logprob for t in entries],
                "top_logprobs": [None if t.logprob is None else
                                 {s: lp for s, (_, lp) in zip(t.top_texts, t.top)}
                                 for t in entries],
                "text_offset": ch.offsets[which]}

    def response(self) -> dict:
        return {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model, "choices": [{
                "index": i, "text": c.text, "logprobs": self.logprobs(c),
                "finish_reason": c.finish_reason, "matched_stop": c.matched_stop
            } for i, c in enumerate(self.choices)], "usage": self.usage()
        }


class GenerateBuilder(ResponseBuilder):
    """SGLang's /generate: {"text", "output_ids", "meta_info"}; a stream sends that whole object
    each time, with the text so far (SGLang's default, non-incremental stream)."""

    def stream_chunks(self, index: int, out: ReqOutput) -> list[dict]:
        self.add(index, out)
        return [self.response()]

    def final_chunks(self) -> list[dict]:
        return []

    def response(self) -> dict:
        c = self.choices[0]
        meta = {
            "id": self.id, "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens, "finish_reason": None
            if c.finish_reason is None else {"type": c.finish_reason, "matched": c.matched_stop}
        }
        if self.want_logprobs:  # SGLang's shape: (logprob, token id, text) per token
            meta["output_token_logprobs"] = [[t.logprob, t.token_id, t.text] for t in c.logprobs]
            meta["output_top_logprobs"] = [
                [[lp, tid, s] for s, (tid, lp) in zip(t.top_texts, t.top)] for t in c.logprobs
            ]
        if c.input_logprobs:  # logprob_start_len >= 0: the prompt's, from that token on
            meta["input_token_logprobs"] = [[t.logprob, t.token_id, t.text]
                                            for t in c.input_logprobs]
            meta["input_top_logprobs"] = [[[lp, tid, s] for s, (tid, lp) in zip(t.top_texts, t.top)]
                                          for t in c.input_logprobs]
        return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}
