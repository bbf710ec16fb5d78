"""Stage 8: structured outputs. A JSON schema, a regex or an EBNF grammar becomes a mask over the
vocabulary at every step (xgrammar), offline and through the server; tool_choice becomes the grammar
of a tool call.

tiny-llama (random weights) is the sharpest test of the mask: left alone it emits noise, constrained
it must still follow the grammar to the character. SmolLM2 (real weights, slow) checks the lesson's
figure: 32 of 32 outputs are valid JSON of the schema, greedy and sampled."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from stage8_server import LLM, SamplingParams  # noqa: E402
from stage8_server.core import Req  # noqa: E402

from test_stage8_server import running_server  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{3}"
EBNF = 'root ::= "a" [bc]+ "d"'
EBNF_AS_REGEX = r"a[bc]+d"
PROMPT = "Describe a person as JSON:"


def valid_person(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    with LLM(tiny_llama_path, verbose=False, max_total_tokens=8192) as llm:
        yield llm


def mixed_params(max_new_tokens: int = 80) -> list[SamplingParams]:
    """Greedy and sampled, with and without a grammar."""
    return [
        SamplingParams(max_new_tokens=max_new_tokens, json_schema=PERSON),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=7, json_schema=PERSON),
        SamplingParams(max_new_tokens=12),
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=8),
        SamplingParams(max_new_tokens=20, regex=REGEX, temperature=0.8, seed=9)
    ]


# ---------------------------------------------------------------- offline
def test_each_grammar_kind_is_followed_greedy_and_sampled(llm):
    params = [SamplingParams(max_new_tokens=96, json_schema=PERSON),
              SamplingParams(max_new_tokens=96, temperature=1.0, seed=1, json_schema=PERSON),
              SamplingParams(max_new_tokens=20, regex=REGEX),
              SamplingParams(max_new_tokens=20, regex=REGEX, temperature=1.0, seed=2),
              SamplingParams(max_new_tokens=30, ebnf=EBNF, temperature=1.0, seed=3)]
    results = llm.generate([PROMPT] * len(params), params)
    # the grammar completed each one
    assert [r.finish_reason for r in results] == ["stop"] * len(params)
    valid_person(results[0].text)
    valid_person(results[1].text)
    assert all(re.fullmatch(REGEX, r.text) for r in results[2:4])
    assert re.fullmatch(EBNF_AS_REGEX, results[4].text)
    unconstrained = llm.generate([PROMPT], SamplingParams(max_new_tokens=30))[0]
    with pytest.raises(ValueError):  # the same model, left alone: not JSON
        json.loads(unconstrained.text)


def test_a_mixed_batch_gives_every_request_the_tokens_it_gets_alone(llm):
    params = mixed_params()
    alone = [llm.generate([PROMPT], p)[0].token_ids for p in params]
    together = llm.generate([PROMPT] * len(params), params)
    assert [r.token_ids for r in together] == alone


def test_a_stop_string_cuts_a_constrained_output(llm):
    ref = llm.generate([PROMPT], SamplingParams(max_new_tokens=96, json_schema=PERSON))[0]
    cut = llm.generate([PROMPT], SamplingParams(max_new_tokens=96, json_schema=PERSON,
                                                stop='"age"'))[0]
    assert cut.finish_reason == "stop" and cut.matched_stop == '"age"'
    assert cut.text == ref.text[: ref.text.index('"age"')]


def test_copies_share_one_compile_and_the_radix_cache(llm):
    schema = dict(PERSON, title="copies")  # a text no earlier test compiled
    prompt = (
        "A prompt long enough to fill whole KV pages, so that the radix cache has them to share. "
        * 2
    )
    params = [
        SamplingParams(max_new_tokens=80, temperature=1.0, seed=s, json_schema=schema)
        for s in range(4)
    ]
    grammars = llm.scheduler.grammars
    compiles = len(grammars.backend.compile_seconds) if grammars.backend else 0
    first = llm.generate([prompt] * 4, params)
    assert len(grammars.backend.compile_seconds) == compiles + 1  # four requests, one compile
    assert all(valid_person(r.text) for r in first)
    again = llm.generate([prompt], params[0])[0]
    assert again.cached_tokens >= 16 and again.token_ids == first[0].token_ids


def test_overlap_scheduler_gives_the_tokens_of_the_synchronous_one(llm, tiny_llama_path):
    params = mixed_params()
    ref = [r.token_ids for r in llm.generate([PROMPT] * len(params), params)]
    with LLM(tiny_llama_path, verbose=False, max_total_tokens=8192,
             disable_overlap=False) as overlapped:
        assert overlapped.scheduler.overlap
        assert [r.token_ids for r in overlapped.generate([PROMPT] * len(params), params)] == ref


def test_bad_grammars_are_refused_by_name_and_the_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams(json_schema=PERSON, regex="a")
    results = llm.generate([PROMPT] * 4, [SamplingParams(json_schema='{"type": "foo"}'),
                                          SamplingParams(regex="[a-"),
                                          SamplingParams(ebnf="root ::= missing"),
                                          SamplingParams(max_new_tokens=3)])
    assert [r.finish_reason for r in results] == ["error"] * 3 + ["length"]
    assert 'invalid json_schema: Unsupported type "foo"' in results[0].error
    assert "invalid regex" in results[1].error and "invalid ebnf" in results[2].error
    # Past the check (add_req is what the server's scheduler calls): the compile fails, the request
    # alone ends.
    req = Req(10**6, llm.encode(PROMPT), SamplingParams(regex="(unclosed"))
    llm.add_req(req)
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert req.finish_reason == "error" and "invalid regex" in req.error
    assert [o.error for o in outputs if o.rid == req.rid] == [req.error]
    assert llm.generate([PROMPT], SamplingParams(max_new_tokens=20,
                                                 regex=REGEX))[0].finish_reason == "stop"


def test_padding_rows_of_the_vocabulary_are_never_sampled(tiny_llama_path, tmp_path):
    """A model whose logits are wider than the tokenizer (lm_head padded): the ids past the
    tokenizer are masked with every other forbidden token, even when they are the most likely."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        shutil.copy(tiny_llama_path / name, tmp_path / name)
    config = json.loads((tiny_llama_path / "config.json").read_text())
    tokenizer_size, config["vocab_size"] = config["vocab_size"], config["vocab_size"] + 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with LLM(tmp_path, verbose=False, max_total_tokens=2048, load_format="dummy") as padded:
        engine, run = padded.engine, padded.engine.run

        def padding_wins(fb):
            with torch.inference_mode():
                logits = run(fb)
                logits[:, tokenizer_size:] += 1e4  # what a padded head's garbage rows could be
            return logits
        engine.run = padding_wins
        free = padded.generate([PROMPT], SamplingParams(max_new_tokens=2))[0]
        assert all(t >= tokenizer_size for t in free.token_ids)  # unconstrained: padding ids win
        out = padded.generate([PROMPT], SamplingParams(max_new_tokens=20, regex=REGEX))[0]
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text)
        assert all(t < tokenizer_size for t in out.token_ids)


def test_tensor_parallel_ranks_each_run_the_matchers_in_lockstep(llm, tiny_llama_path):
    """tp 2 on gloo: every rank compiles and matches on its own; the ranks agree on when a compiled
    grammar's request is admitted, and the sync check compares every step's batch and tokens across
    the ranks."""
    params = mixed_params()
    # compiled while the others run: ready at different times per rank
    schema = dict(PERSON, title="tp")
    params.append(SamplingParams(max_new_tokens=80, json_schema=schema))
    ref = llm.generate([PROMPT] * len(params), params)
    with LLM(tiny_llama_path, verbose=False, max_total_tokens=4096, tp_size=2,
             enable_tp_sync_check=True) as tp:
        results = tp.generate([PROMPT] * len(params), params)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert [results[i].token_ids for i in greedy] == [ref[i].token_ids for i in greedy]
    assert valid_person(results[1].text) and re.fullmatch(REGEX, results[4].text)


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with running_server(tiny_llama_path, "--max-total-tokens", "8192", "--served-model-name",
                        "tiny") as server:
        yield server


MESSAGES = [{"role": "user", "content": "Describe a person."}]
RESPONSE_FORMAT = {
    "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}
}


def chat(server, **kwargs):
    return server.client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                 **{"temperature": 0, "max_tokens": 96, **kwargs})


def test_response_format_regex_and_ebnf_through_every_route(server, llm):
    out = chat(server, response_format=RESPONSE_FORMAT).choices[0]
    ref = llm.generate([llm.apply_chat_template(MESSAGES)],
                       SamplingParams(max_new_tokens=96, json_schema=PERSON))
    # the offline engine's tokens
    assert out.finish_reason == "stop" and out.message.content == ref[0].text
    valid_person(out.message.content)
    streamed = chat(server, response_format=RESPONSE_FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.message.content
    # json_object: any JSON object, the grammar of the schema {"type": "object"} (its strings may
    # run past max_tokens with random weights; SmolLM2 closes them)
    anything = chat(server, response_format={"type": "json_object"}, max_tokens=24).choices[0]
    ref = llm.generate([llm.apply_chat_template(MESSAGES)],
                       SamplingParams(max_new_tokens=24, json_schema={"type": "object"}))[0]
    assert anything.message.content == ref.text and ref.text.startswith("{")
    text = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=96,
                                            temperature=0.7, extra_body={
                                                "json_schema": json.dumps(PERSON)
                                            }).choices[0].text
    valid_person(text)
    text = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                            extra_body={"regex": REGEX}).choices[0].text
    assert re.fullmatch(REGEX, text)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 30, "ebnf": EBNF}}
    assert re.fullmatch(EBNF_AS_REGEX, server.http.post("/generate", json=body).json()["text"])


def test_n_copies_each_follow_the_schema(server):
    out = chat(server, response_format=RESPONSE_FORMAT, n=4, temperature=1.0, seed=11)
    texts = [c.message.content for c in out.choices]
    assert all(valid_person(t) for t in texts) and len(set(texts)) > 1


BAD = [({
    "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "foo"}}
    }
}, 'invalid json_schema: Unsupported type "foo"', None), ({"regex": "[a-"}, "invalid regex", None),
       ({"ebnf": "root ::= missing"}, 'invalid ebnf: .*Rule "missing" is not defined', None),
       ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
        "needs json_schema.schema", "response_format"),
       ({"response_format": {"type": "json_object"},
         "regex": "a"}, "at most one of response_format, regex", "regex")]


@pytest.mark.parametrize("extra,message,param", BAD,
                         ids=["schema", "regex", "ebnf", "no-schema", "two"])
def test_a_bad_grammar_is_a_400_naming_it_and_the_server_goes_on(server, extra, message, param):
    resp = server.http.post("/v1/chat/completions", json=dict(messages=MESSAGES, max_tokens=4,
                                                              **extra))
    assert resp.status_code == 400, resp.text
    assert re.search(message,
                     resp.json()["error"]["message"]) and resp.json()["error"]["param"] == param
    assert chat(server, max_tokens=2).choices[0].finish_reason == "length"


WEATHER = {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}
    }, "required": ["city", "days"], "additionalProperties": False
}
TOOLS = [{
    "type": "function", "function": {
        "name": "get_weather", "description": "Forecast for a city", "parameters": WEATHER
    }
}, {"type": "function", "function": {"name": "get_person", "parameters": PERSON}}]
SCHEMAS = {"get_weather": WEATHER, "get_person": PERSON}


def test_tool_choice_naming_a_function_returns_a_tool_call(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(server, tools=TOOLS, tool_choice=named).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith(
        "call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(chat(server, tools=TOOLS, tool_choice=named, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(
        d.index == 0 for d in deltas)
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "tool_calls"
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_some_of_the_tools(server, stream):
    calls = []
    for seed, parallel in ((1, True), (2, True), (3, False)):
        kwargs = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                      temperature=1.0, seed=seed, max_tokens=200)
        if stream:
            chunks = list(chat(server, stream=True, **kwargs))
            found = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            choice = chat(server, **kwargs).choices[0]
            found, finish = choice.message.tool_calls, [choice.finish_reason]
        assert finish == ["tool_calls"] and found and (parallel or len(found) == 1)
        for call in found:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls += found
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("extra,message", [
    ({"tools": TOOLS}, 'tool_choice "auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, 'tool_choice "auto"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}
      }, "'nope', which is not"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}
      }, "at most one"),
], ids=["tools-alone", "auto", "unknown", "no-tools", "and-response-format"])
def test_tool_choices_that_cannot_be_honoured_are_400s(server, extra, message):
    resp = server.http.post("/v1/chat/completions", json=dict(messages=MESSAGES, max_tokens=4,
                                                              **extra))
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text


# ---------------------------------------------------------------- SmolLM2: the lesson's figure
def people_prompts(llm) -> list[list[int]]:
    names = ["Ada", "Bo", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
    jobs = ["baker", "pilot", "nurse", "farmer"]
    return [
        llm.apply_chat_template(
            f"Give the name and age of a {job} called {name}, and whether they belong "
            "to a union.") for name in names for job in jobs
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_smollm2_json_schema_outputs_are_valid_for_32_of_32_prompts(smollm2_path, temperature):
    with LLM(smollm2_path, verbose=False, max_total_tokens=16384) as llm:
        prompts = people_prompts(llm)
        params = [
            SamplingParams(max_new_tokens=128, temperature=temperature, seed=i, json_schema=PERSON)
            for i in range(len(prompts))
        ]
        results = llm.generate(prompts, params)
    assert len(results) == 32 and all(valid_person(r.text) for r in results), [
        r.text for r in results
    ]
