"""The HTTP request bodies (OpenAI's and SGLang's native /generate), as strict pydantic models, and
their mapping onto the engine's SamplingParams names.

The API server checks shape and types here (a string where a number belongs, a field nobody knows,
malformed JSON: 400 naming the field); the tokenizer worker checks every value against the engine
(ranges, vocabulary, context). Unknown fields are refused rather than ignored: a client that sends
`logit_bias` learns that this server does not do it, instead of getting an answer that silently
differs from what it asked for.

Structured outputs: `response_format` (json_object, json_schema), SGLang's extra fields `regex` and
`ebnf`, and `tool_choice` naming a function or "required" all become one grammar, SamplingParams'
json_schema, regex or ebnf (at most one per request). A tool call is then the constrained output,
returned as message.tool_calls (ToolCallFormat). tool_choice "auto" is refused: deciding *whether*
to call a tool is written in each model's own tool-call format (tokens its chat template defines),
which this server does not parse.

Two conventions make real clients work without weakening that:
- `null` means "not set", for every optional field (OpenAI's SDKs and proxies send it): it is
  dropped before validation, so the field takes its default.
- A value that asks for nothing this server would do differently is accepted and dropped (NO_OPS):
  `store: false`, `tools: []`, `tool_choice: "none"` (with whatever tools: none may be called),
  `response_format: {"type": "text"}`, and `parallel_tool_calls` once no tools are left. Other
  values of tools, tool_choice and response_format ask for structured output (above); `store: true`
  is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 128  # OpenAI's limit on n
# torch.Generator.manual_seed takes [-2**63, 2**64 - 1], a negative seed wrapping modulo 2**64; the
# engine takes [0, 2**64 - 1] (SamplingParams). Copy i of a request samples with seed + i, so
# seed + n - 1 must fit too.
SEED_MIN, SEED_MAX = 0, 2**64 - 1


class APIError(Exception):
    """Becomes an OpenAI-shaped error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message, "type": kind, "param": self.param, "code": self.code
            }
        }


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """APIError.body(), as /openapi.json declares it."""

    error: ErrorDetail


# Values that ask for nothing this server would do differently: accepted, dropped before validation.
NO_OPS = {"store": [False], "tools": [[]], "response_format": [{"type": "text"}]}


class Strict(BaseModel):
    # allow_inf_nan=False: NaN and infinities (JSON's NaN, Infinity, 1e400) refused in every float
    # field, by name
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def null_is_absent(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def check_finite(value, where: str = ""):
    """A JSON value (a schema) as given, or ValueError naming the first NaN or infinity in it: a
    grammar built from one would not be JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a number must be finite, got {value} at {where or 'the top'}")
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, item in items:
        check_finite(item, f"{where}.{key}" if where else str(key))
    return value


def check_seed(seed: int | None, n: int) -> None:
    if seed is not None and seed + n - 1 > SEED_MAX:
        raise APIError(400, f"seed: copy i of a request samples with seed + i, so seed + n - 1 "
                       f"must be at most 2**64 - 1; with n={n}, seed may be at most "
                       f"{SEED_MAX - n + 1}", "seed")


def drop_no_ops(body: dict) -> dict:
    """A request body without its nulls and NO_OPS values (see the module docstring)."""
    body = {k: v for k, v in body.items() if v is not None}
    if body.get("tool_choice") == "none":  # no tool may be called: the tools change nothing here
        del body["tool_choice"]
        body.pop("tools", None)
    body = {k: v for k, v in body.items() if not (k in NO_OPS and v in NO_OPS[k])}
    if "tools" not in body:
        body.pop("parallel_tool_calls", None)  # how to call several tools at once: there are none
    return body


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage in every chunk


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class JSONSchemaSpec(Strict):
    """response_format's json_schema: OpenAI's {name, description, schema, strict}."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # `schema` is a pydantic method's name
    strict: bool | None = None  # the output always follows the schema here, strict or not

    _finite = field_validator("schema_")(check_finite)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]  # "text" alone is a no-op (dropped)
    json_schema: JSONSchemaSpec | None = None

    def grammar(self) -> str:
        """-> SamplingParams.json_schema. json_object: any JSON object (SGLang maps it the same
        way)."""
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           "response_format")
        return json.dumps(self.json_schema.schema_)


class SamplingFields(Strict):
    """What chat and completions share: OpenAI's parameters, then SGLang's extras (sent as extra
    body fields)."""

    model: str | None = None  # None: the one model this server serves
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1.0, OpenAI's default
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # OpenAI's end-user id: accepted; this server has no accounts to use it for
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's: the output matches this regular expression
    ebnf: str | None = None  # SGLang's: the output follows this EBNF grammar

    @model_validator(mode="before")
    @classmethod
    def no_op_is_absent(cls, data):
        return drop_no_ops(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def seed_fits_every_copy(self):
        check_seed(self.seed, self.n)
        return self

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        """OpenAI names -> SamplingParams names; what is not given keeps the engine's default."""
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "ignore_eos": self.ignore_eos
        }
        for name in ("top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty", "stop_token_ids"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return dict(params, **self.grammar_params())

    def grammar_params(self, tool_schema: str | None = None) -> dict:
        """The request's grammar, as SamplingParams' json_schema / regex / ebnf; at most one may be
        given."""
        given = {}  # the request's field name -> (SamplingParams name, text)
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = ("json_schema", self.response_format.grammar())
        if tool_schema is not None:
            given["tool_choice"] = ("json_schema", tool_schema)
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(self, name, None) is not None:
                given[name] = (name, getattr(self, name))
        if len(given) > 1:
            raise APIError(
                400, f"give at most one of {', '.join(given)}: each asks for its own grammar",
                list(given)[1])
        return dict(given.values())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: the usage so far in every chunk (with include_usage only,
        as in vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: none
    strict: bool | None = None

    _finite = field_validator("parameters")(check_finite)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


@dataclass
class ToolCallFormat:
    """How a chat output becomes message.tool_calls. name set (tool_choice named it): the output is
    that function's arguments. None ("required"): a JSON array of {"name", "parameters"} objects,
    one per call."""

    name: str | None
    json_schema: str  # the grammar of that output


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["auto", "required"], NamedToolChoice, None] = None  # "none": dropped
    parallel_tool_calls: bool = True  # "required" with False: exactly one call

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        params = super().sampling_params(max_new_tokens)
        tools = self.tool_format()
        return params if tools is None else dict(params, **self.grammar_params(tools.json_schema))

    def tool_format(self) -> ToolCallFormat | None:
        """tools + tool_choice -> the grammar of the call(s), or None without tools."""
        if self.tools is None:
            if self.tool_choice is not None:
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return None
        functions = {t.function.name: t.function for t in self.tools}
        if len(functions) < len(self.tools):
            raise APIError(400, "tools must have distinct function names", "tools")
        choice = "auto" if self.tool_choice is None else self.tool_choice
        if choice == "auto":
            raise APIError(
                400, 'tool_choice "auto" (the default with tools) lets the model decide whether to '
                "call a tool, in a tool-call format of its own that this server does not parse; "
                'send tool_choice "required", or name a function: {"type": "function", '
                '"function": {"name": ...}}', "tool_choice")
        if choice == "required":
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                  "parameters": parameters_schema(f)},
                 "required": ["name", "parameters"]} for name, f in functions.items()]}}
            if not self.parallel_tool_calls:
                calls["maxItems"] = 1
            return ToolCallFormat(None, json.dumps(calls))
        function = functions.get(choice.function.name)
        if function is None:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(functions)})", "tool_choice")
        return ToolCallFormat(function.name, json.dumps(parameters_schema(function)))

    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def logprob_args(self) -> tuple[bool, int]:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return self.logprobs, self.top_logprobs or 0


def parameters_schema(function: FunctionDefinition) -> dict:
    return function.parameters if function.parameters is not None else {
        "type": "object", "properties": {}
    }


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists: one choice per prompt
    # (times n).
    prompt: Union[str, list[str], list[int], list[list[int]]]
    json_schema: str | None = None  # SGLang's: the output follows this JSON schema (its text)
    max_tokens: int = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    # how many top tokens per position (OpenAI's legacy shape)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt first, in the text and (with logprobs) in the logprobs

    def max_new_tokens(self) -> int:
        """max_tokens 0 (lm-eval's loglikelihood: score the prompt, generate nothing) runs the
        prefill, which samples one token whatever happens; the response leaves it out."""
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 is allowed only with echo)",
                           "max_tokens")
        return max(self.max_tokens, 1)

    @property
    def logprob_start_len(self) -> int:
        """SGLang's logprob_start_len: echo with logprobs scores every prompt token (the first one
        gets null)."""
        return 0 if self.echo and self.logprobs is not None else -1

    def prompts(self) -> list[dict]:
        """Each prompt as GenerateReqInput fields: {"text": ...} or {"input_ids": ...}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"text": p}]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [{"input_ids": list(p)}]
        return [{"text": x} if isinstance(x, str) else {"input_ids": list(x)} for x in p]


class GenerateSamplingParams(Strict):
    """/generate's sampling_params: SGLang's (= SamplingParams') names."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    json_schema: str | None = None  # structured outputs: at most one of these three
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(Strict):
    """SGLang's native POST /generate: one prompt, as text or token ids."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    logprob_start_len: int = Field(-1, ge=-1)  # >= 0: also the prompt's logprobs from this token on
