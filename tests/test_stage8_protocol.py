"""Stage 8: the server as real clients use it, and at its edges.

One tiny-llama server whose KV pool (256 tokens) is smaller than the model's context (2048) and
whose prefills are cut every 64 tokens: default max_tokens, prompt logprobs (echo) across chunks and
the radix cache, vLLM's continuous usage, null and no-op fields, the routes and content types
clients send, usage with n > 1, the integrity check on demand, the playground's "new chat"; and,
last, SIGTERM with a stream open stops that server."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import textwrap

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_stage8_server import random_prompt, running_server  # noqa: E402

POOL, CHUNK = 256, 64


@pytest.fixture(scope="module")
def small(tiny_llama_path):
    with running_server(tiny_llama_path, "--max-total-tokens", str(POOL), "--chunked-prefill-size",
                        str(CHUNK), "--served-model-name", "tiny-llama") as server:
        yield server


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_path):
    """transformers' log-softmax at every position of a sequence: [len, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)

    def reference(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    return reference


def complete(server, **kwargs):
    return server.client.completions.create(model="tiny-llama", **{"temperature": 0, **kwargs})


def post(server, path: str, body: dict) -> httpx.Response:
    return server.http.post(path, json=body)


# ---------------------------------------------------------------- max_tokens: all a request gets
def test_default_max_tokens_is_what_the_kv_pool_leaves(small):
    messages = [{"role": "user", "content": " ".join(["count"] * 200)}]  # ~210 tokens, templated
    chat = small.client.chat.completions.create(model="tiny-llama", messages=messages,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    # The pool, not the 2048-token context, bounds it.
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == POOL
    with pytest.raises(openai.BadRequestError, match=f"max_tokens may be at most {POOL - 2}") as e:
        complete(small, prompt="one two", max_tokens=POOL)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=f"The KV cache holds {POOL} tokens"):
        complete(small, prompt=[7] * POOL)


# ---------------------------------------------------------------- echo: the prompt's logprobs
def check_logprobs(lp, ids: list[int], ref, top: int) -> None:
    """The prompt part of an echo's logprobs against transformers' log-softmax."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores token 0
    for t in range(1, len(ids)):
        assert abs(lp.token_logprobs[t] - ref[t - 1, ids[t]].item()) < 1e-3
        assert sorted(lp.top_logprobs[t].values(), reverse=True) == pytest.approx(
            ref[t - 1].topk(top).values.tolist(), abs=1e-3)


def test_echo_scores_every_prompt_token_across_chunks(small, hf_logprobs, tiny_llama_path):
    from transformers import AutoTokenizer

    ids = random_prompt(random.Random(11), 150)  # three prefill chunks of 64 tokens
    ref = hf_logprobs(ids)
    comp = complete(small, prompt=ids, max_tokens=0, echo=True, logprobs=3)
    choice, lp = comp.choices[0], comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    check_logprobs(lp, ids, ref, 3)
    assert choice.finish_reason == "length" and comp.usage.completion_tokens == 0
    # A token-id prompt is echoed as its decoded text; each offset is where a token's text starts.
    assert choice.text == AutoTokenizer.from_pretrained(tiny_llama_path).decode(ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    # Generating after the prompt: the generated tokens follow, scored, placed after the prompt.
    gen = complete(small, prompt=ids, max_tokens=3, echo=True, logprobs=1,
                   extra_body={"ignore_eos": True})
    glp = gen.choices[0].logprobs
    assert len(glp.tokens) == len(ids) + 3 and gen.usage.completion_tokens == 3
    assert glp.token_logprobs[len(ids)] == pytest.approx(ref[-1].max().item(), abs=1e-3)  # greedy
    assert glp.text_offset[len(ids)] == len(choice.text)
    assert gen.choices[0].text.startswith(choice.text)

    # The same, streamed: the first chunk carries the prompt; the pieces add up to the whole.
    chunks = list(complete(small, prompt=ids, max_tokens=3, echo=True, logprobs=1, stream=True,
                           extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == gen.choices[0].text
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == glp.token_logprobs


def test_echo_recomputes_what_the_radix_cache_holds(small, hf_logprobs):
    ids = random_prompt(random.Random(12), 120)
    first = complete(small, prompt=ids, max_tokens=1)
    again = complete(small, prompt=ids, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 112  # plain requests use the cache
    echo = complete(small, prompt=ids, max_tokens=1, echo=True, logprobs=2)
    assert echo.usage.prompt_tokens_details.cached_tokens == 0  # its scored positions: computed
    check_logprobs(echo.choices[0].logprobs, ids, hf_logprobs(ids), 2)
    assert echo.choices[0].text.endswith(first.choices[0].text)

    text = "The quick brown fox"  # a text prompt is echoed as sent
    comp = complete(small, prompt=text, max_tokens=0, echo=True)
    assert comp.choices[0].text == text and comp.choices[0].logprobs is None
    lp = complete(small, prompt=text, max_tokens=0, echo=True, logprobs=0).choices[0].logprobs
    gen = post(small, "/generate", {"text": text, "return_logprob": True, "logprob_start_len": 0,
                                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert [x[0] for x in gen.json()["meta_info"]["input_token_logprobs"]] == lp.token_logprobs
    state = small.wait_idle()
    assert state["integrity"] == "ok" and state["num_used_pages"] == 0


# ---------------------------------------------------------------- usage
def test_continuous_usage_stats_in_every_chunk(small):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for create, kwargs in ((small.client.chat.completions.create, chat),
                           (small.client.completions.create, {"prompt": "Hello"})):
        chunks = list(create(model="tiny-llama", max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                             extra_body={"ignore_eos": True}, **kwargs))
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5 and not chunks[-1].choices
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks)
    plain = list(complete(small, prompt="Hello", max_tokens=3, stream=True,
                          stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_cached_tokens_count_each_prompt_once_as_prompt_tokens_do(small):
    ids = random_prompt(random.Random(13), 40)
    before = small.state()["prompt_tokens_cached"]
    out = complete(small, prompt=ids, max_tokens=2, temperature=0.8, n=4, seed=5)
    assert out.usage.prompt_tokens == 40 and out.usage.prompt_tokens_details.cached_tokens == 0
    # The copies did reuse the first one's pages: the server counts that.
    assert small.state()["prompt_tokens_cached"] - before == 3 * 32
    again = complete(small, prompt=ids, max_tokens=2, n=3)
    assert again.usage.prompt_tokens == 40 and again.usage.prompt_tokens_details.cached_tokens == 32


# ---------------------------------------------------------------- what clients send
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
NULLS = dict.fromkeys(["n", "stream", "logprobs", "top_logprobs", "tools", "tool_choice",
                       "response_format", "metadata", "parallel_tool_calls", "stop", "seed",
                       "stream_options", "user", "temperature", "store"])
NO_OPS = {"store": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
          "parallel_tool_calls": True}
NO_TOOL = {"tool_choice": "none", "parallel_tool_calls": False,
           "tools": [{"type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize("extra", [NULLS, NO_OPS, NO_TOOL], ids=["nulls", "no-ops", "no-tool"])
def test_nulls_and_no_ops_are_accepted(small, extra):
    resp = post(small, "/v1/chat/completions", dict(CHAT, **extra))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "n": None, "logprobs": None,
            "echo": None, "stream": None, "response_format": {"type": "text"}}
    resp = post(small, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1


def test_what_is_not_a_no_op_is_still_refused(small):
    resp = post(small, "/v1/chat/completions", dict(CHAT, store=True))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "store"
    resp = post(small, "/v1/completions", {"prompt": "Hi", "max_tokens": 0})
    assert resp.status_code == 400 and "only with echo" in resp.json()["error"]["message"]


def test_models_retrieve_methods_and_content_types(small):
    assert small.client.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError) as err:
        small.client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"
    assert err.value.body["type"] == "invalid_request_error"

    resp = small.http.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "use POST" in error["message"]

    # only JSON declared as such: text/plain and forms are what a web page may send cross-site
    form = "application/x-www-form-urlencoded"  # what curl -d sends
    for content_type in (form, "text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        resp = small.http.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
        assert resp.status_code == 415, (content_type, resp.text)
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    resp = small.http.post("/v1/completions", content="prompt=Hi",
                           headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "malformed JSON" in resp.json()["error"]["message"]


def test_integrity_check_runs_on_demand(small):
    state = small.http.get("/get_server_info").json()["internal_state"]
    assert state["integrity"].startswith("not checked")  # a status poll does not walk the tree
    state = small.http.get("/get_server_info", params={"check": 1}).json()["internal_state"]
    assert state["integrity"] == "ok"


# ---------------------------------------------------------------- the playground's "new chat"
PLAYGROUND_DRIVER = textwrap.dedent("""
    const vm = require("vm");
    const base = process.argv[process.argv.length - 1];
    const html = require("fs").readFileSync(0, "utf8");
    const script = html.split("<script>")[1].split("</script>")[0];
    function el(id) {  // as much of a DOM element as the page uses; textContent = "" empties it
      return {id, value: {temperature: "0", max_tokens: "200"}[id] || "", text: "", children: [],
              get textContent() { return this.text; },
              set textContent(v) { this.text = v; this.children = []; },
              listeners: {}, addEventListener(kind, f) { this.listeners[kind] = f; },
              appendChild(c) { this.children.push(c); }};
    }
    const els = {};
    const ctx = vm.createContext({
      console, performance, TextDecoder, AbortController, setTimeout,
      fetch: (url, opts) => fetch(base + url, opts),
      document: {getElementById: id => els[id] || (els[id] = el(id)),
                 createElement: () => el("div")},
    });
    vm.runInContext(script, ctx);
    const sleep = ms => new Promise(r => setTimeout(r, ms));
    (async () => {
      await sleep(300);  // the model name
      const log = els["log"];
      vm.runInContext("send('Tell me a long story')", ctx);
      const answer = () => log.children[1] && log.children[1].textContent;
      for (let i = 0; i < 200 && !answer(); i++) await sleep(50);
      const streamed = Boolean(answer());
      els["reset"].listeners.click();  // "new chat" while the answer streams
      await sleep(1500);  // where a late reply of the old answer would land
      console.log(JSON.stringify({streamed, messages: vm.runInContext("messages", ctx),
                                  lines: log.children.length, busy: vm.runInContext("busy", ctx)}));
    })();
""")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_playground_new_chat_aborts_the_stream_and_drops_its_reply(small):
    before = small.state()["num_aborted_requests"]
    out = subprocess.run(["node", "-e", PLAYGROUND_DRIVER, "--", small.url], capture_output=True,
                         input=small.http.get("/").text, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["streamed"], "the answer never started streaming"
    assert result["messages"] == [] and result["lines"] == 0 and not result["busy"]
    # The server saw the disconnect and aborted: it did not run to 200 tokens.
    state = small.wait_idle(timeout=10)
    assert state["num_aborted_requests"] == before + 1 and state["num_used_pages"] == 0


# ---------------------------------------------------------------- SIGTERM, last: it stops `small`
def test_sigterm_ends_live_streams_then_exits_cleanly(small):
    body = {"prompt": "Once", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.Client(base_url=small.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    small.proc.send_signal(signal.SIGTERM)
    assert small.proc.wait(30) == 0
    assert len(events) < 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "shutting down" in error["message"]
    stderr = small.stderr()
    assert "Traceback" not in stderr and "Exception" not in stderr, stderr
    assert "timeout graceful shutdown exceeded" not in stderr  # the stream ended, not cancelled
