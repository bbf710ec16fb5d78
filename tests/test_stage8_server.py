"""Stage 8: the OpenAI-compatible server, tested through the official `openai` client against live servers on
127.0.0.1 (tiny-llama for speed, SmolLM2 for real text and its chat template), compared with the offline LLM."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from stage8_server import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, stderr_path: Path, api_key: str | None = None):
        self.proc, self.url, self.stderr_path = proc, url, stderr_path
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=60)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, timeout=60, headers=headers)
        self.pids = self.info()["processes"]

    def info(self) -> dict:
        resp = self.http.get("/get_server_info", params={"check": 1})  # + the integrity check
        resp.raise_for_status()
        return resp.json()

    def state(self) -> dict:
        return self.info()["internal_state"]

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["num_running"] == 0 and state["num_waiting"] == 0:
                return state
            assert time.monotonic() < deadline, f"server still busy after {timeout} s: {state}"
            time.sleep(0.1)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: it only waits for its parent to read its status
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@contextmanager
def running_server(model_path, *args: str, api_key: str | None = None):
    """`python -m stage8_server --port 0 ...` in a subprocess (api_key: given as $SGLANG_API_KEY, and sent by
    the Server's clients); stops it (SIGTERM) and checks nothing is left."""
    stderr_file = tempfile.NamedTemporaryFile(prefix="stage8-", suffix=".err", delete=False)
    env = dict(os.environ, SGLANG_API_KEY=api_key) if api_key else None
    proc = subprocess.Popen([sys.executable, "-m", "stage8_server", "--model", str(model_path), "--port", "0",
                             "--quiet", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr_file, text=True,
                            env=env, start_new_session=True)  # a process group of its own, as a terminal would give it
    url, lines = None, []
    deadline = time.monotonic() + START_TIMEOUT_S

    def read_url():
        nonlocal url
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving "):
                url = line.split(" at ")[1].split()[0]
                return

    reader = threading.Thread(target=read_url, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    try:
        assert url is not None, f"server did not start: {''.join(lines)}\n{Path(stderr_file.name).read_text()}"
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        server = Server(proc, url, Path(stderr_file.name), api_key)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(30) == 0, "SIGTERM should stop the server cleanly (exit status 0)"
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
        if url is not None and "server" in locals():
            left = [name for name, pid in server.pids.items() if pid_alive(pid)]
            assert not left, f"processes left running after the server stopped: {left}"
        os.unlink(stderr_file.name)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    with running_server(tiny_llama_path, "--max-total-tokens", "32768", "--served-model-name", "tiny-llama") as server:
        yield server


@pytest.fixture(scope="module")
def tiny_offline(tiny_llama_path):
    with LLM(tiny_llama_path, verbose=False, max_total_tokens=32768) as llm:
        yield llm


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


# ---------------------------------------------------------------- tiny-llama: the API against the offline LLM
def test_chat_and_completion_match_offline_greedy(tiny, tiny_offline):
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = tiny.client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12,
                                               temperature=0)
    ids = tiny_offline.apply_chat_template(messages)
    ref = tiny_offline.generate([ids], SamplingParams(max_new_tokens=12))[0]
    assert chat.object == "chat.completion" and chat.model == "tiny-llama"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].finish_reason == ref.finish_reason
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == len(ref.token_ids)
    assert chat.usage.total_tokens == len(ids) + len(ref.token_ids)

    comp = tiny.client.completions.create(model="tiny-llama", prompt="The capital of France is", max_tokens=10,
                                          temperature=0)
    ref = tiny_offline.generate(["The capital of France is"], SamplingParams(max_new_tokens=10))[0]
    assert comp.object == "text_completion"
    assert comp.choices[0].text == ref.text
    assert comp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert comp.usage.completion_tokens == len(ref.token_ids)
    assert [m.id for m in tiny.client.models.list().data] == ["tiny-llama"]


def test_completion_prompt_forms_and_default_max_tokens(tiny, tiny_offline):
    rng = random.Random(1)
    ids_a, ids_b = random_prompt(rng, 9), random_prompt(rng, 5)
    comp = tiny.client.completions.create(model="tiny-llama", prompt=[ids_a, ids_b], temperature=0, n=2)
    refs = tiny_offline.generate([ids_a, ids_b], SamplingParams(max_new_tokens=16))  # OpenAI's default: 16
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert [c.text for c in comp.choices] == [refs[0].text, refs[0].text, refs[1].text, refs[1].text]
    assert comp.usage.prompt_tokens == len(ids_a) + len(ids_b)  # each prompt counted once, whatever n
    assert comp.usage.completion_tokens == 2 * (len(refs[0].token_ids) + len(refs[1].token_ids))
    comp = tiny.client.completions.create(model="tiny-llama", prompt=["one", "two"], max_tokens=3, temperature=0)
    assert [c.text for c in comp.choices] == [r.text for r in tiny_offline.generate(
        ["one", "two"], SamplingParams(max_new_tokens=3))]


def test_64_concurrent_streams_give_the_offline_tokens(tiny, tiny_offline):
    rng = random.Random(0)
    prompts = [random_prompt(rng, rng.randint(3, 40)) for _ in range(64)]
    lengths = [rng.randint(4, 32) for _ in range(64)]

    def stream(i: int):
        chunks = list(tiny.client.completions.create(
            model="tiny-llama", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert not chunks[-1].choices and chunks[-1].usage is not None  # the usage chunk comes last
        return text, reasons, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(stream, range(64)))
    refs = tiny_offline.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    for (text, reasons, completion_tokens), ref, n in zip(results, refs, lengths):
        assert text == ref.text
        assert reasons == ["length"] and completion_tokens == n == len(ref.token_ids)
    state = tiny.wait_idle()
    assert state["integrity"] == "ok" and state["num_used_pages"] == 0


def test_stop_string_across_tokens_ends_generation(tiny, tiny_offline):
    prompt = "Once upon a time"
    ref = tiny_offline.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    tok = tiny_offline.tokenizer
    # A stop string from the middle of token 9 to the middle of token 10: it spans a token boundary.
    start = len(tok.decode(ref.token_ids[:9]))
    piece10 = tok.decode(ref.token_ids[:10])[start:]
    piece11 = tok.decode(ref.token_ids[:11])[start + len(piece10):]
    assert len(piece10) >= 2 and len(piece11) >= 2, "pick another prompt: these tokens are too short"
    stop = piece10[1:] + piece11[:1]
    cut = ref.text.index(stop)
    needed = next(k for k in range(1, 31) if stop in tok.decode(ref.token_ids[:k]))  # tokens up to the match

    comp = tiny.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=30, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
    assert comp.choices[0].text == ref.text[:cut]
    assert comp.choices[0].finish_reason == "stop"
    assert comp.usage.completion_tokens == needed  # nothing generated after the stop
    chunks = list(tiny.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=30, temperature=0,
                                                 stop=stop, stream=True, extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].text for c in chunks]
    assert "".join(deltas) == ref.text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(stop[:2] in d for d in deltas)  # no piece of the stop string went out


def test_seeds_reproducible_and_n_copies_share_the_cached_prompt(tiny):
    def sample(seed, n=1, prompt="Tell me a story"):
        return tiny.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=1.0,
                                              seed=seed, n=n)

    a, b, c = sample(123), sample(123), sample(7)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    many = sample(123, n=3)
    assert [ch.text for ch in many.choices] == [ch.text for ch in sample(123, n=3).choices]
    assert len({ch.text for ch in many.choices}) == 3  # each copy draws its own tokens (seed + copy index)

    ids = random_prompt(random.Random(99), 40)  # 2 full pages of 16: what the radix cache can share
    cached_before = tiny.state()["prompt_tokens_cached"]
    out = tiny.client.completions.create(model="tiny-llama", prompt=ids, max_tokens=4, temperature=0.8, n=4,
                                         seed=5)
    assert out.usage.prompt_tokens == 40  # counted once, and nothing of it was cached before:
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    # The first copy computes the prompt; the three others find its 32 cached tokens.
    assert tiny.state()["prompt_tokens_cached"] - cached_before == 3 * 32


def test_logprobs_are_the_models(tiny, tiny_offline, tiny_llama_path):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)

    def reference(prompt_ids, output_ids):  # HF's log-softmax at each generated position: [len(output), vocab]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1 : -1]
        return torch.log_softmax(logits.float(), -1)

    messages = [{"role": "user", "content": "Hi"}]
    chat = tiny.client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=3)
    prompt_ids = tiny_offline.apply_chat_template(messages)
    out_ids = tiny_offline.generate([prompt_ids], SamplingParams(max_new_tokens=6))[0].token_ids
    ref = reference(prompt_ids, out_ids)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(out_ids) == 6
    for step, (entry, token_id) in enumerate(zip(content, out_ids)):
        assert entry.token == tiny_offline.tokenizer.decode([token_id], skip_special_tokens=False)
        assert abs(entry.logprob - ref[step, token_id].item()) < 1e-4
        top = ref[step].topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the most likely
    assert "".join(e.token for e in content) == chat.choices[0].message.content

    comp = tiny.client.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=5, temperature=0,
                                          logprobs=2)
    gen = tiny.http.post("/generate", json={"text": "Hello there", "return_logprob": True, "top_logprobs_num": 2,
                                            "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    ref = reference(tiny_offline.encode("Hello there"), gen["output_ids"])
    for step, (logprob, token_id, _) in enumerate(gen["meta_info"]["output_token_logprobs"]):
        assert abs(logprob - ref[step, token_id].item()) < 1e-4
        assert lp.token_logprobs[step] == pytest.approx(logprob, abs=1e-6)  # /v1/completions: the same numbers
        assert [x[1] for x in gen["meta_info"]["output_top_logprobs"][step]] == ref[step].topk(2).indices.tolist()


def test_streaming_chat_shape_and_generate_endpoint(tiny):
    chunks = list(tiny.client.chat.completions.create(model="tiny-llama", messages=[{"role": "user",
                  "content": "Hi"}], max_tokens=5, temperature=0, stream=True, n=2))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [m.finish_reason for m in mine][-1] == "length" and all(m.finish_reason is None for m in mine[:-1])
    chunks = list(tiny.client.chat.completions.create(model="tiny-llama", messages=[{"role": "user",
                  "content": "Hi"}], max_tokens=5, temperature=0, stream=True, logprobs=True, top_logprobs=2))
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == "".join(c.choices[0].delta.content or "" for c in chunks)
    with tiny.http.stream("POST", "/generate", json={"text": "Hello", "stream": True,
                                                     "sampling_params": {"max_new_tokens": 4}}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["meta_info"]["completion_tokens"] == len(last["output_ids"]) == 4
    assert last["meta_info"]["finish_reason"]["type"] == "length"


BAD_REQUESTS = [
    # (path, body (a str is sent as is), status, error param, error code)
    ("/v1/completions", '{"prompt": "x", ', 400, None, None),
    ("/v1/completions", '["not", "an", "object"]', 400, None, None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, None, "invalid_value"),
    ("/v1/completions", {"prompt": [5] * 2048}, 400, None, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4000}, 400, None, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4000, "stream": True}, 400, None, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, 400, None, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400, None, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model",
     "model_not_found"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "text", None),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}, 400,
     "sampling_params.bogus", None),
    ("/v1/nothing", {}, 404, None, None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_REQUESTS, ids=[f"{b[0]}-{i}" for i, b in
                                                                          enumerate(BAD_REQUESTS)])
def test_bad_request_gets_its_status_and_openai_error_then_server_serves(tiny, path, body, status, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    resp = tiny.http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    ok = tiny.client.completions.create(model="tiny-llama", prompt="ok", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_openai_client_raises_on_errors(tiny):
    with pytest.raises(openai.NotFoundError):
        tiny.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        tiny.client.completions.create(model="tiny-llama", prompt=[7] * 3000)


def test_disconnect_mid_stream_aborts_and_frees_every_page(tiny):
    before = tiny.state()["num_aborted_requests"]
    body = {"model": "tiny-llama", "prompt": random_prompt(random.Random(3), 50), "max_tokens": 1900,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tiny.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 5:
                    break  # leaving the block closes the connection mid-stream
    state = tiny.wait_idle(timeout=10)
    assert state["num_aborted_requests"] == before + 1  # aborted, not run to its 1900 tokens
    assert state["integrity"] == "ok" and state["num_used_pages"] == 0
    tiny.http.post("/flush_cache").raise_for_status()
    state = tiny.state()
    assert state["num_free_pages"] == state["num_total_pages"] and state["tree_tokens"] == 0


def test_idle_scheduler_does_not_spin(tiny):
    pid = tiny.pids["scheduler"]
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        pytest.skip("needs /proc (Linux) to read a process's CPU time")
    cpu = lambda: sum(int(x) for x in stat.read_text().split(")")[-1].split()[11:13]) / os.sysconf("SC_CLK_TCK")  # noqa: E731
    tiny.wait_idle()
    start = cpu()
    time.sleep(2.0)
    assert cpu() - start < 0.3  # blocked on its socket, not polling in a loop


def test_playground_and_health(tiny):
    assert tiny.http.get("/health").json() == {"status": "ok"}
    page = tiny.http.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/v1/chat/completions" in page.text and "getReader" in page.text


def test_non_streaming_client_that_leaves_is_aborted(tiny):
    before = tiny.state()["num_aborted_requests"]
    body = {"model": "tiny-llama", "prompt": random_prompt(random.Random(4), 20), "max_tokens": 1900,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    state = tiny.wait_idle(timeout=10)
    assert state["num_aborted_requests"] == before + 1 and state["num_used_pages"] == 0


@pytest.mark.parametrize("victim", ["scheduler", "tokenizer worker", "detokenizer worker"])
def test_a_dead_worker_stops_the_server(tiny_llama_path, victim):
    with running_server(tiny_llama_path, "--max-total-tokens", "4096") as server:
        pid = server.pids[victim]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(30)
        assert time.monotonic() - start < 15
        assert code != 0
        assert f"the {victim} (pid {pid}) died" in server.stderr()
        left = [name for name, pid in server.pids.items() if pid_alive(pid)]
        assert not left, f"still running after the launcher exited: {left}"


def test_a_failed_start_names_the_process_and_exits(tiny_llama_path):
    # A KV pool that cannot hold one page is found by the scheduler process, once the weights are in memory.
    proc = subprocess.run([sys.executable, "-m", "stage8_server", "--model", str(tiny_llama_path), "--port", "0",
                           "--mem-fraction-static", "1e-9"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "error: the scheduler failed to start" in proc.stderr and "no room for a KV cache" in proc.stderr
    assert "serving" not in proc.stdout
    # An option that is wrong whatever the model is refused before any process starts.
    proc = subprocess.run([sys.executable, "-m", "stage8_server", "--model", str(tiny_llama_path), "--port", "0",
                           "--max-total-tokens", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "max_total_tokens=1 holds no page of 16 tokens" in proc.stderr
    assert "scheduler" not in proc.stderr and "serving" not in proc.stdout


def test_ctrl_c_stops_every_process(tiny_llama_path):
    with running_server(tiny_llama_path, "--max-total-tokens", "4096") as server:
        os.killpg(server.proc.pid, signal.SIGINT)  # Ctrl-C: the whole group gets it, children included
        assert server.proc.wait(30) == 0
        assert not [name for name, pid in server.pids.items() if pid_alive(pid)]
        assert "Traceback" not in server.stderr()  # the children ignore SIGINT: the launcher stops them in order


# ---------------------------------------------------------------- SmolLM2: real text, the chat template
@pytest.fixture(scope="module")
def smol(smollm2_path):
    with running_server(smollm2_path, "--max-total-tokens", "16384",
                        "--served-model-name", "smollm2") as server:
        yield server


def test_smollm2_chat_matches_offline_and_stops_on_a_string(smol, smollm2_path):
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    with LLM(smollm2_path, verbose=False, max_total_tokens=4096) as llm:
        ids = llm.apply_chat_template(messages)
        ref = llm.generate([ids], SamplingParams(max_new_tokens=40))[0]
    chat = smol.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == ref.text and "Paris" in ref.text
    assert chat.usage.prompt_tokens == len(ids)
    stop = "Paris"
    chunks = list(smol.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40,
                                                      temperature=0, stop=[stop], stream=True,
                                                      stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text[: ref.text.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    again = smol.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt: its full pages were cached


def test_tensor_parallel_server_gives_the_offline_tokens(tiny_llama_path, tiny_offline):
    """--tp-size 2: the scheduler process is rank 0 and spawns rank 1; concurrent streams, the same tokens, and
    SIGTERM stops every rank too."""
    rng = random.Random(5)
    prompts = [random_prompt(rng, rng.randint(3, 30)) for _ in range(8)]
    with running_server(tiny_llama_path, "--tp-size", "2", "--max-total-tokens", "8192",
                        "--served-model-name", "tiny-llama", "--enable-tp-sync-check") as server:
        def complete(prompt):
            return server.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12,
                                                    temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, prompts))
        refs = tiny_offline.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert texts == [r.text for r in refs]
        scheduler_pid = server.pids["scheduler"]
        ranks = subprocess.run(["pgrep", "-P", str(scheduler_pid)], capture_output=True, text=True).stdout.split()
        assert ranks, "rank 1 runs as a child of the scheduler process"
    time.sleep(1)
    assert not any(pid_alive(int(pid)) for pid in ranks), "no rank outlives the server"
