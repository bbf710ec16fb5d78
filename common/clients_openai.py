"""clients_check's rows for the official `openai` SDK (see common/clients_check.py).

Every request is greedy (temperature 0) unless it says otherwise, so a streamed answer can be
compared with the same request not streamed: the server must give the same text both ways.
"""

from __future__ import annotations

import json

from .clients_check import Context, check, need

MESSAGES = [{"role": "user", "content": "Name three rivers in Europe."}]
PROMPT = "The three largest cities of France are"
PERSON_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
}
PERSON_MESSAGES = [
    {"role": "user", "content": "Invent a person. Answer in JSON with a name and an age."}
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
STRUCTURED_MAX_TOKENS = 64


def client(ctx: Context):
    need("openai")
    import openai

    if "openai" not in ctx.memo:
        ctx.memo["openai"] = openai.OpenAI(
            base_url=f"{ctx.url}/v1", api_key="x", max_retries=0, timeout=600
        )
    return ctx.memo["openai"]


def short(text: str, n: int = 48) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def validate(obj, schema: dict) -> str:
    """Check obj against a JSON schema with jsonschema; '' when it passed, a note when it could not
    be checked (jsonschema missing: the object was parsed, its schema not checked)."""
    try:
        import jsonschema
    except ImportError:
        return " (schema not checked: jsonschema is not installed)"
    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"output breaks the schema: {exc.message}: {obj!r}") from None
    return ""


def parse_json(text: str, finish_reason: str | None):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"not valid JSON ({exc.msg}; finish {finish_reason}): {short(text, 80)}"
        ) from None


# ---------------------------------------------------------------- plain generation
def greedy_chat(ctx: Context) -> str:
    """The non-streamed greedy answer to MESSAGES (computed once, shared by two rows)."""
    if "chat" not in ctx.memo:
        r = client(ctx).chat.completions.create(
            model=ctx.model, messages=MESSAGES, max_tokens=16, temperature=0
        )
        ctx.memo["chat"] = r
    return ctx.memo["chat"]


@check("openai", "chat.completions.create, not streamed")
def chat(ctx: Context) -> str:
    r = greedy_chat(ctx)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content, f"no answer: {r}"
    assert ch.finish_reason in ("stop", "length"), f"finish_reason {ch.finish_reason!r}"
    u = r.usage
    assert (
        1 <= u.completion_tokens <= 16 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    ), u
    answer = short(ch.message.content)
    return f"{u.prompt_tokens} + {u.completion_tokens} tokens, finish {ch.finish_reason}: {answer}"


@check("openai", "chat.completions.create, streamed (include_usage)")
def chat_stream(ctx: Context) -> str:
    chunks = list(
        client(ctx).chat.completions.create(
            model=ctx.model,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    whole = greedy_chat(ctx)
    assert text == whole.choices[0].message.content, f"streamed {short(text)} != not streamed"
    assert finish == [whole.choices[0].finish_reason], f"finish reasons {finish}"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage
    return f"{len(chunks)} chunks, the same text and usage as not streamed"


@check("openai", "completions.create, streamed and not")
def completions(ctx: Context) -> str:
    c = client(ctx)
    r = c.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert text and r.usage.completion_tokens >= 1, r
    chunks = list(
        c.completions.create(
            model=ctx.model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == text, f"streamed {short(streamed)} != not streamed {short(text)}"
    return f"{r.usage.completion_tokens} tokens, {len(chunks)} chunks, same text: {short(text)}"


@check("openai", "n=2 (chat, streamed and not)")
def n_two(ctx: Context) -> str:
    c = client(ctx)
    kw = dict(model=ctx.model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5, n=2)
    r = c.chat.completions.create(**kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1], [ch.index for ch in r.choices]
    assert all(ch.message.content for ch in r.choices), r
    assert (
        r.choices[0].message.content != r.choices[1].message.content
    ), "both choices alike (seeds?)"
    streamed = {0: "", 1: ""}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == [
        ch.message.content for ch in sorted(r.choices, key=lambda x: x.index)
    ], f"seeded stream {streamed} differs from the same request not streamed"
    tokens = r.usage.completion_tokens
    return f"2 different choices, {tokens} tokens; seeded: the stream gives the same two"


@check("openai", "chat logprobs + top_logprobs=3")
def chat_logprobs(ctx: Context) -> str:
    r = client(ctx).chat.completions.create(
        model=ctx.model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(
            tops, reverse=True
        ), f"top_logprobs {t.top_logprobs}"
        assert t.logprob <= 0 and t.top_logprobs[0].token == t.token, f"greedy token not top-1: {t}"
        assert abs(t.logprob - tops[0]) < 1e-6 and bytes(t.bytes) == t.token.encode(), t
    text = "".join(t.token for t in content)
    assert text == r.choices[0].message.content, f"tokens {short(text)} != content"
    return f"{len(content)} tokens, each the top-1 of its 3, logprob {content[0].logprob:.3f} first"


@check("openai", "completions logprobs=3")
def completion_logprobs(ctx: Context) -> str:
    r = client(ctx).completions.create(
        model=ctx.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    ), lp
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert (
            1 <= len(top) <= 3 and abs(max(top.values()) - logprob) < 1e-6
        ), f"greedy {tok!r} not top-1: {top}"
    assert "".join(lp.tokens) == r.choices[0].text, "the tokens do not add up to the text"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)], lp.text_offset
    return f"{n} tokens, top-1 = the token, text_offset consistent"


# ---------------------------------------------------------------- structured outputs
@check("openai", "response_format json_schema")
def json_schema(ctx: Context) -> str:
    r = client(ctx).chat.completions.create(
        model=ctx.model,
        messages=PERSON_MESSAGES,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )
    ch = r.choices[0]
    obj = parse_json(ch.message.content, ch.finish_reason)
    return f"valid JSON{validate(obj, PERSON_SCHEMA)}: {short(ch.message.content, 60)}"


@check("openai", "response_format json_object")
def json_object(ctx: Context) -> str:
    r = client(ctx).chat.completions.create(
        model=ctx.model,
        messages=PERSON_MESSAGES,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    ch = r.choices[0]
    obj = parse_json(ch.message.content, ch.finish_reason)
    assert isinstance(obj, dict), f"a JSON object was asked for, got {type(obj).__name__}"
    return f"a JSON object: {short(ch.message.content, 60)}"


@check("openai", "chat.completions.parse(response_format=pydantic model)")
def sdk_parse(ctx: Context) -> str:
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    c = client(ctx)
    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    r = parse(
        model=ctx.model,
        messages=PERSON_MESSAGES,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        response_format=Person,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person), f"message.parsed is {parsed!r}"
    return f"message.parsed = {parsed!r}"


@check("openai", "tool_choice naming a function")
def tool_choice(ctx: Context) -> str:
    r = client(ctx).chat.completions.create(
        model=ctx.model,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    assert (
        len(calls) == 1
    ), f"expected one tool call, got {calls!r} (content {short(ch.message.content or '')})"
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id, call
    args = parse_json(call.function.arguments, ch.finish_reason)
    note = validate(args, WEATHER_TOOL["function"]["parameters"])
    return f"tool_calls[0] get_weather({call.function.arguments}){note}, finish {ch.finish_reason}"
