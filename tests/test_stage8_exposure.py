"""Stage 8: the server under hostile input, and who may use it (README, "Exposing the server").

One tiny-llama server with an API key (from $SGLANG_API_KEY), an allowed origin and host name, and
small limits; requests an attacker or a careless client would send: seeds that do not fit, NaN,
lone surrogates, bodies that are not JSON or too large, fan-outs, prompts longer than any context,
other Hosts and Origins; the playground with the key; /openapi.json and a bounded schemathesis
pass. Then two starts of their own: a SIGKILLed launcher's ipc folder removed by the next start,
and rank 1 of a tensor-parallel server in /get_server_info."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_stage8_protocol import PLAYGROUND_DRIVER  # noqa: E402
from test_stage8_server import ROOT, pid_alive, running_server  # noqa: E402

KEY = "test-key-1234"
POOL = 256  # the KV pool: a prompt has at most POOL - 1 tokens
BODY_LIMIT, MAX_REQUESTS = 65536, 4
GOOD_ORIGIN, PROXY_HOST = "http://good.example", "proxy.example"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@contextmanager
def keyed_server(model_path, *args: str):
    """`python -m stage8_server` with SGLANG_API_KEY set; yields (process, url); stops it and checks that
    nothing is left running (test_stage8_server.running_server)."""
    with running_server(model_path, *args, api_key=KEY) as server:
        yield server.proc, server.url


class Guarded:
    def __init__(self, proc, url: str):
        self.proc, self.url = proc, url
        self.http = httpx.Client(base_url=url, timeout=60,
                                 headers={"Authorization": f"Bearer {KEY}"})
        self.anonymous = httpx.Client(base_url=url, timeout=60)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def post(self, path: str, body, **headers) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return self.http.post(path, content=content,
                              headers={"Content-Type": "application/json", **headers})

    def serves(self) -> None:
        """The server still answers an ordinary request."""
        out = self.client.completions.create(model="tiny-llama", prompt="ok", max_tokens=2,
                                             temperature=0)
        assert out.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def guarded(tiny_llama_path):
    with keyed_server(tiny_llama_path, "--max-total-tokens", str(POOL), "--served-model-name",
                      "tiny-llama", "--allowed-origins", GOOD_ORIGIN, "--allowed-hosts",
                      PROXY_HOST, "--max-request-body-bytes", str(BODY_LIMIT),
                      "--max-requests-per-call", str(MAX_REQUESTS)) as (proc, url):
        server = Guarded(proc, url)
        yield server
        server.http.close()
        server.anonymous.close()


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---------------------------------------------------------------- items 1-2: values that killed it
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", dict(CHAT, seed=2**64)),
    ("/v1/chat/completions", dict(CHAT, seed=2**64 - 1, n=2)),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 2**64, "temperature": 0}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 2**64 - 2, "n": 3}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": -1}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "seed": 2**64}}),
])
def test_a_seed_torch_cannot_take_is_a_400_and_the_server_goes_on(guarded, path, body):
    error = error_of(guarded.post(path, body), 400)
    assert error["param"] in ("seed", "sampling_params.seed")
    assert error["type"] == "invalid_request_error"
    guarded.serves()


def test_the_largest_seeds_that_fit_are_served(guarded):
    out = guarded.client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, n=2,
                                            seed=2**64 - 2)
    assert len(out.choices) == 2
    out = guarded.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                      "seed": 2**64 - 1}})
    assert out.status_code == 200, out.text


@pytest.mark.parametrize("path,body,param", [
    ("/generate", '{"text": "x", "sampling_params": {"temperature": NaN}}',
     "sampling_params.temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     "top_p"),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    ("/v1/completions", '{"prompt": "x", "min_p": 1e400}', "min_p"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "n", "schema": {"maximum": NaN}}}}',
     "response_format.json_schema.schema"),
])
def test_non_finite_numbers_are_refused_naming_the_field(guarded, path, body, param):
    error = error_of(guarded.post(path, body), 400)
    assert error["param"] == param and "finite" in error["message"]
    guarded.serves()


def test_a_lone_surrogate_is_named_as_such(guarded):
    body = '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    message = error_of(guarded.post("/v1/chat/completions", body), 400)["message"]
    assert "lone UTF-16 surrogate" in message and "\\ud800" in message
    assert "hex escape" not in message
    pair = '{"prompt": "a\\ud83d\\ude00", "max_tokens": 1}'  # a whole character: served
    assert guarded.post("/v1/completions", pair).status_code == 200


# ---------------------------------------------------------------- item 4: who may use it
def test_every_route_but_health_and_the_page_needs_the_key(guarded):
    anon = guarded.anonymous
    for method, path in [("GET", "/v1/models"), ("GET", "/get_server_info"),
                         ("POST", "/flush_cache"), ("GET", "/openapi.json"),
                         ("POST", "/v1/chat/completions"), ("POST", "/generate")]:
        error = error_of(anon.request(method, path), 401)
        assert error["code"] == "invalid_api_key"
        wrong = anon.request(method, path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert anon.get("/health").json() == {"status": "ok"}
    assert "api_key" in anon.get("/").text  # the playground page asks for the key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in guarded.client.models.list().data] == ["tiny-llama"]
    guarded.serves()
    info = guarded.http.get("/get_server_info").json()
    assert info["server_args"]["api_key"] == "<set>" and KEY not in json.dumps(info)
    assert guarded.http.post("/flush_cache").status_code == 200  # no body: no Content-Type needed


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_declared_json_is_a_415(guarded, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    resp = guarded.http.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    assert error_of(resp, 415)["code"] == "unsupported_media_type"
    ok = guarded.http.post("/v1/chat/completions", content=json.dumps(CHAT),
                           headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_only_the_bound_address_and_allowed_names_are_answered(guarded):
    port = guarded.url.rsplit(":", 1)[1]
    for host in [f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"]:
        resp = guarded.http.get("/v1/models", headers={"Host": host})
        assert error_of(resp, 421)["code"] == "host_not_allowed"
    assert guarded.anonymous.get("/health", headers={"Host": "evil.example"}).status_code == 421
    for host in [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", PROXY_HOST,
                 f"{PROXY_HOST.upper()}:443"]:
        assert guarded.http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_other_origins_get_no_cors_and_are_refused(guarded):
    own = guarded.url  # the playground's own requests
    resp = guarded.post("/v1/chat/completions", CHAT, Origin=own)
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    for origin in ["http://evil.example", "null", "http://good.example:8080"]:
        resp = guarded.post("/v1/chat/completions", CHAT, Origin=origin)
        assert error_of(resp, 403)["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in resp.headers
        preflight = guarded.anonymous.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 403
        assert "access-control-allow-origin" not in preflight.headers
    # a page without the key cannot even flush the cache: a body-less POST, which browsers send
    # cross-site unasked
    resp = guarded.anonymous.post("/flush_cache", headers={"Origin": "http://evil.example"})
    assert resp.status_code == 403


def test_an_allowed_origin_gets_cors_and_its_preflight_answered(guarded):
    preflight = guarded.anonymous.options("/v1/chat/completions", headers={
        "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "Authorization" in preflight.headers["access-control-allow-headers"]
    resp = guarded.post("/v1/chat/completions", CHAT, Origin=GOOD_ORIGIN)
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == GOOD_ORIGIN
    no_key = guarded.anonymous.get("/v1/models", headers={"Origin": GOOD_ORIGIN})
    assert no_key.status_code == 401  # an allowed origin still needs the key
    assert no_key.headers["access-control-allow-origin"] == GOOD_ORIGIN  # so its page can read why


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_the_playground_sends_the_key_it_is_given(guarded):
    driver = PLAYGROUND_DRIVER.replace('{temperature: "0", max_tokens: "200"}',
                                       f'{{temperature: "0", max_tokens: "200", api_key: "{KEY}"}}')
    assert driver != PLAYGROUND_DRIVER
    out = subprocess.run(["node", "-e", driver, "--", guarded.url], capture_output=True,
                         input=guarded.anonymous.get("/").text, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["streamed"], "no answer streamed"


# ---------------------------------------------------------------- item 5: how much one request asks
def test_a_body_over_the_limit_is_a_413_before_it_is_read(guarded):
    big = json.dumps({"prompt": "x" * BODY_LIMIT, "max_tokens": 1})
    error = error_of(guarded.post("/v1/completions", big), 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]

    def chunks():  # no Content-Length: counted as it is read
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'", "max_tokens": 1}'

    resp = guarded.http.post("/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"})
    assert error_of(resp, 413)["code"] == "request_too_large"
    guarded.serves()


def test_prompts_times_n_is_capped_per_request(guarded):
    error = error_of(guarded.post("/v1/completions", {"prompt": ["a", "b"], "n": 3}), 400)
    assert error["param"] == "prompt" and f"at most {MAX_REQUESTS}" in error["message"]
    error = error_of(guarded.post("/v1/chat/completions", dict(CHAT, n=MAX_REQUESTS + 1)), 400)
    assert error["param"] == "n" and "--max-requests-per-call" in error["message"]
    out = guarded.client.completions.create(model="tiny-llama", prompt=["a", "b"], n=2,
                                            max_tokens=1, temperature=0)
    assert len(out.choices) == MAX_REQUESTS


def test_a_prompt_of_more_bytes_than_can_fit_is_refused_before_tokenizing(guarded,
                                                                          tiny_llama_path):
    """SmolLM2's tokenizer (tiny-llama's too) is byte-level BPE; its longest entry, a newline and 80
    spaces, is 81 bytes: a prompt of (POOL - 1) x 81 bytes may still fit, one byte more cannot.
    The bound is tight: those 81 bytes repeated are one token each."""
    from stage8_server.server.access import max_token_bytes

    assert max_token_bytes(tiny_llama_path) == 81
    longest = "\n" + " " * 80
    fits = guarded.client.completions.create(model="tiny-llama", prompt=longest * (POOL - 1),
                                             max_tokens=1, temperature=0)
    assert fits.usage.prompt_tokens == POOL - 1
    for path, body, param in [
            ("/v1/completions", {"prompt": longest * (POOL - 1) + " ", "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": ["ok", "y" * (81 * POOL)], "max_tokens": 1}, "prompt"),
            ("/generate", {"text": "z" * (81 * POOL)}, "text"),
            ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "w" * (81 * POOL)}]}, "messages")]:
        error = error_of(guarded.post(path, body), 400)
        assert error["param"] == param and error["code"] == "context_length_exceeded"
        assert f"at most {(POOL - 1) * 81} bytes" in error["message"]  # counted, not tokenized


# ---------------------------------------------------------------- item 6: the schema is the contract
def test_openapi_describes_every_request_body(guarded):
    schema = guarded.http.get("/openapi.json").json()
    for path, model in [("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/completions", "CompletionRequest"), ("/generate", "GenerateRequest")]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "422" not in schema["paths"][path]["post"]["responses"]
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and chat["additionalProperties"] is False
    assert "seed" in chat["properties"] and "ResponseFormat" in schema["components"]["schemas"]


def bound_generation(body) -> None:
    """At most 8 generated tokens per request that would be served (a longer max_tokens that the
    context refuses is left as it is): the pass looks for errors, not long answers."""
    if not isinstance(body, dict):
        return
    params = body.get("sampling_params") if "sampling_params" in body or "text" in body or \
        "input_ids" in body else body
    if isinstance(params, dict):
        names = [n for n in ("max_tokens", "max_completion_tokens", "max_new_tokens")
                 if isinstance(params.get(n), int)]
        for name in names:
            if params[name] < POOL:
                params[name] = min(params[name], 8)
        if not names:
            params["max_new_tokens" if params is not body else "max_tokens"] = 8


def test_schemathesis_finds_no_server_error_and_every_response_conforms(guarded):
    """Schema-valid bodies for every route (a bounded, deterministic pass: a few examples each),
    on 127.0.0.1 with the key: no 5xx, every status declared, every error body OpenAI's shape."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                     response_schema_conformance, status_code_conformance)

    schema = schemathesis.openapi.from_url(f"{guarded.url}/openapi.json",
                                           headers={"Authorization": f"Bearer {KEY}"})
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    start = time.monotonic()
    for operation in operations:
        if operation.path == "/flush_cache":
            continue  # harmless, but it would empty the cache of the tests around it

        @given(case=operation.as_strategy())
        @settings(max_examples=10, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            bound_generation(case.body)
            response = case.call(base_url=guarded.url, timeout=60,
                                 headers={"Authorization": f"Bearer {KEY}"})
            case.validate_response(response, checks=checks)

        run()
    assert time.monotonic() - start < 120
    guarded.serves()


# ---------------------------------------------------------------- item 7: small things
def free_port_in_use() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_a_killed_launchers_ipc_folder_is_removed_at_the_next_start(tiny_llama_path):
    tmp = Path(tempfile.gettempdir())
    live, unproven = (Path(tempfile.mkdtemp(prefix="sglz-", dir=tmp)) for _ in range(2))
    lock = os.open(live / "owner.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # its owner (this test) is alive
    (unproven / "api").touch()  # no owner.lock: nothing proves it stale
    proc = subprocess.Popen([sys.executable, "-m", "stage8_server", "--model",
                             str(tiny_llama_path), "--port", "0", "--quiet"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline, folder = time.monotonic() + 120, None
        while folder is None and time.monotonic() < deadline:
            new = [f for f in tmp.glob(f"sglz-{proc.pid}-*") if (f / "owner.lock").exists()]
            folder = new[0] if new else None
            time.sleep(0.05)
        assert folder is not None, "the launcher made no ipc folder"
        proc.kill()  # SIGKILL: no cleanup of its own
        proc.wait(30)
        assert folder.exists()
        busy = free_port_in_use()
        with busy:  # a start that fails at once (its port is taken), after the cleanup
            out = subprocess.run([sys.executable, "-m", "stage8_server", "--model",
                                  str(tiny_llama_path), "--port", str(busy.getsockname()[1])],
                                 cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "cannot listen" in out.stderr
        assert not folder.exists(), "the stale folder is still there"
        assert live.exists() and unproven.exists()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the scheduler it had started, if still there
        except ProcessLookupError:
            pass
        os.close(lock)
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(unproven, ignore_errors=True)


def test_tensor_parallel_rank_1_is_in_the_process_list(tiny_llama_path):
    with keyed_server(tiny_llama_path, "--tp-size", "2", "--max-total-tokens", "1024") as (proc,
                                                                                           url):
        info = httpx.get(f"{url}/get_server_info", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=60).json()
        pids = info["processes"]
        assert set(pids) == {"api_server", "scheduler", "tokenizer worker", "detokenizer worker",
                             "tp rank 1"}
        rank1 = pids["tp rank 1"]
        assert pid_alive(rank1) and len(set(pids.values())) == len(pids)
        assert Path(f"/proc/{rank1}/stat").read_text().split(")")[1].split()[1] == str(
            pids["scheduler"])  # its parent: the scheduler process (rank 0)
    deadline = time.monotonic() + 10
    while pid_alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank1), "rank 1 outlived the server"
