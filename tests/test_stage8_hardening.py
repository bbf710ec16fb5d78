"""Stage 8 under hostile input: one request that fails (a seed torch refuses, a fault in its own processing, a
pass that raises) ends alone with an error, its pages freed, while every other request goes on, at tp 1 and tp 2;
tiny temperatures are greedy; a grammar is bounded in size and depth and compiles under a time limit, beside plain
requests that keep their latency."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stage8_server import LLM, SamplingParams
from stage8_server.constrained import MAX_GRAMMAR_BYTES, check_grammar
from stage8_server.scheduler import output_processor, run_batch

GOOD = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def tiny_llm(path, tp: int = 1, **options) -> LLM:
    return LLM(str(path), attention_backend="torch", tp_size=tp, max_total_tokens=4096,
               enable_tp_sync_check=tp > 1, verbose=False, **options)


def params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, ignore_eos=True, **kw)


def run_all(llm: LLM, rids: set[int]) -> dict[int, tuple[list[int], str, str | None]]:
    """Step until every rid finished -> rid: (tokens, finish_reason, error)."""
    tokens: dict[int, list[int]] = {rid: [] for rid in rids}
    ends = {}
    for _ in range(200):
        for out in llm.step():
            if out.rid in tokens:
                tokens[out.rid] += out.new_token_ids
                if out.finished:
                    ends[out.rid] = (tokens[out.rid], out.finish_reason, out.error)
        if len(ends) == len(rids):
            return ends
    raise AssertionError(f"not finished after 200 steps: {sorted(rids - set(ends))}")


def assert_clean(llm: LLM) -> None:
    llm.scheduler.check_integrity()
    assert not llm.has_unfinished_requests() and llm.scheduler.cache.num_used_pages == 0


def nested_schema(depth: int, width: int = 0) -> str:
    """`depth` objects each inside the last (plus `width` integer properties at each level)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        props = {f"p{i}": {"type": "integer"} for i in range(width)}
        schema = {"type": "object", "properties": {**props, "a": schema}, "required": ["a"]}
    return json.dumps(schema)


def deep_schema_text(depth: int) -> str:
    """As nested_schema, built as text (json.dumps itself recurses too deep for 5,000)."""
    text = '{"type": "string"}'
    for _ in range(depth):
        text = '{"type": "object", "properties": {"a": ' + text + '}}'
    return text


# ---------------------------------------------------------------- one request fails alone
@pytest.mark.parametrize("tp", [1, 2])
def test_a_seed_torch_refuses_fails_its_request_alone(tiny_llama_path, tp):
    """A seed past 64 bits that add_request's check missed (changed after it: at tp 2 it then reaches every rank
    so) raises while the step adds the request (torch.Generator.manual_seed would, or the check every rank runs
    again then); that request ends with an error, the others give the tokens they give alone, no page is left."""
    with tiny_llm(tiny_llama_path, tp) as llm:
        alone = [r.token_ids for r in llm.generate(GOOD, params())]
        rids = [llm.add_request(p, params()) for p in GOOD[:2]]
        bad_params = params(temperature=0.7, seed=1)
        bad = llm.add_request([20, 21, 22], bad_params)
        bad_params.seed = 2**64  # past the validation
        rids.append(llm.add_request(GOOD[2], params()))
        ends = run_all(llm, {*rids, bad})
        assert ends[bad][1] == "error" and ends[bad][0] == []
        assert "internal error while adding it" in ends[bad][2] and "seed" in ends[bad][2]
        assert [ends[r][0] for r in rids] == alone and all(ends[r][1] == "length" for r in rids)
        assert_clean(llm)
        assert [r.token_ids for r in llm.generate(GOOD, params())] == alone  # and it goes on serving


@pytest.mark.parametrize("tp", [1, 2])
def test_a_fault_in_one_requests_processing_on_rank_0_alone_drops_it_on_every_rank(tiny_llama_path, tp,
                                                                                   monkeypatch):
    """A fault injected into one request's stop checks, on rank 0 only (this process; the other rank runs the
    real code, as text streaming runs on rank 0 alone): every rank drops that request at the same step (the tp
    sync check compares every step's batch and outputs), the others go on."""
    bad_rid = 100
    real = output_processor.check_finished

    def faulty(scheduler, req, token_id, num_output):
        if req.rid == bad_rid and num_output == 3:
            raise RuntimeError("fault injected into request 100")
        return real(scheduler, req, token_id, num_output)

    with tiny_llm(tiny_llama_path, tp) as llm:
        alone = [r.token_ids for r in llm.generate(GOOD, params())]
        monkeypatch.setattr(output_processor, "check_finished", faulty)
        llm._next_rid = bad_rid
        bad = llm.add_request([30, 31, 32], params())
        rids = [llm.add_request(p, params()) for p in GOOD]
        ends = run_all(llm, {bad, *rids})
        assert ends[bad][1] == "error" and "fault injected into request 100" in ends[bad][2]
        assert [ends[r][0] for r in rids] == alone
        assert_clean(llm)


def test_a_pass_that_raises_fails_its_batch_and_the_engine_goes_on(tiny_llama_path, monkeypatch):
    """A failure inside the launched pass (here sampling) cannot be pinned on one request: every request of
    that batch ends with an error, its pages freed (not cached), and the next requests run as before."""
    real = run_batch.sample_tensor
    poisoned = {"rid": 200}

    def faulty(logits, reqs, generators):
        if any(r.rid == poisoned["rid"] for r in reqs):
            raise RuntimeError("fault injected into a pass")
        return real(logits, reqs, generators)

    with tiny_llm(tiny_llama_path) as llm:
        alone = [r.token_ids for r in llm.generate(GOOD, params())]
        monkeypatch.setattr(run_batch, "sample_tensor", faulty)
        rids = [llm.add_request(p, params()) for p in GOOD[:2]]
        llm.step()  # their prefill
        llm._next_rid = 200
        bad = llm.add_request([40, 41, 42], params())
        ends = run_all(llm, {*rids, bad})
        assert ends[bad][1] == "error" and "fault injected into a pass" in ends[bad][2]
        assert_clean(llm)
        poisoned["rid"] = None
        assert [r.token_ids for r in llm.generate(GOOD, params())] == alone
        assert_clean(llm)


# ---------------------------------------------------------------- temperatures
def test_tiny_temperatures_are_greedy_and_non_finite_numbers_refused(tiny_llama_path):
    with tiny_llm(tiny_llama_path) as llm:
        greedy = [r.token_ids for r in llm.generate(GOOD, params())]
        for temperature in (1e-300, 1e-7):
            out = llm.generate(GOOD, params(temperature=temperature, seed=3))
            assert [r.token_ids for r in out] == greedy, temperature
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                SamplingParams(**{name: value})
    for seed in (2**64, -1):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
            SamplingParams(seed=seed)


# ---------------------------------------------------------------- grammars
def test_grammar_size_and_depth_limits_are_refused_by_name():
    """A 5,000-deep schema is refused by name, not by a RecursionError (json.loads, xgrammar's parser)."""
    with pytest.raises(ValueError, match="nests 10001 levels.*limit is 64 .MAX_JSON_SCHEMA_DEPTH"):
        check_grammar(SamplingParams(json_schema="[" * 10001 + "]" * 10001))
    with pytest.raises(ValueError, match="nests 10001 levels"):  # the server's check: no parse
        check_grammar(SamplingParams(json_schema="[" * 10001 + "]" * 10001), parse=False)
    with pytest.raises(ValueError, match="nests 65 levels"):
        check_grammar(SamplingParams(json_schema=nested_schema(32)))
    with pytest.raises(ValueError, match=f"limit is {MAX_GRAMMAR_BYTES} .MAX_GRAMMAR_BYTES"):
        check_grammar(SamplingParams(json_schema=deep_schema_text(5000)))  # 250 KB, 10,001 deep
    with pytest.raises(ValueError, match="MAX_GRAMMAR_BYTES"):
        check_grammar(SamplingParams(regex="a" * (MAX_GRAMMAR_BYTES + 1)))
    check_grammar(SamplingParams(json_schema=nested_schema(31, width=70)))  # 62 KB, 63 deep: allowed


def test_a_grammar_past_its_compile_time_fails_alone(tiny_llama_path):
    """A regex that takes ~1 s to compile (TokenizerInfo's build included) against a 0.2 s limit: its request
    ends with an error naming the limit; a plain request beside it finishes normally."""
    with tiny_llm(tiny_llama_path, grammar_compile_timeout=0.2) as llm:
        slow = llm.add_request([7, 8, 9], params(regex="[a-z]{0,5000}"))
        plain = llm.add_request(GOOD[0], params())
        ends = run_all(llm, {slow, plain})
        assert ends[slow][1] == "error" and "grammar_compile_timeout = 0.2 s" in ends[slow][2]
        assert ends[plain][1] == "length" and len(ends[plain][0]) == 8
        assert_clean(llm)


# ---------------------------------------------------------------- through the server
MESSAGES = [{"role": "user", "content": "Say something."}]
# A plain 8-token chat must finish within this many seconds more than it takes alone while heavy grammars
# compile beside it. Their parse and compile run on the scheduler's grammar threads, off the tokenizer worker's
# loop and without the GIL: what remains is their share of the CPU (measured on a shared 2-core CPU: 0.17 s
# alone, 4.2 s beside four of the heaviest schemas the limits allow, each of which took ~8 s).
GRAMMAR_STALL_BOUND_S = 6.0


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    from test_stage8_server import running_server

    with running_server(tiny_llama_path, "--max-total-tokens", "8192", "--served-model-name", "tiny") as server:
        yield server


def chat_seconds(server, **extra) -> tuple[float, object]:
    start = time.perf_counter()
    resp = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8,
                                                          "temperature": 0, **extra})
    return time.perf_counter() - start, resp


def test_huge_seeds_are_refused_and_the_server_goes_on(server):
    for path, body in [("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "seed": 2**64}),
                       ("/v1/completions", {"model": "tiny", "prompt": "Hi", "seed": 2**64 - 1, "n": 2}),
                       ("/generate", {"text": "Hi", "sampling_params": {"seed": 2**64, "max_new_tokens": 4}})]:
        resp = server.http.post(path, json=body)
        assert resp.status_code == 400 and "seed" in resp.text, (path, resp.text)
    _, resp = chat_seconds(server, seed=2**64 - 2, n=2)  # the largest seed n = 2 allows
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
    assert server.state()["integrity"] == "ok"


def wide_format(i: int) -> dict:
    """The heaviest kind of schema the limits allow (62 KB, 63 deep: ~0.5 s to parse), a different one per i."""
    schema = json.loads(nested_schema(31, 70).replace('"p0"', f'"q{i}"'))
    return {"type": "json_schema", "json_schema": {"name": f"wide{i}", "schema": schema}}


def test_heavy_grammars_neither_stall_a_plain_request_nor_pass_their_limits(server):
    """Four of the heaviest schemas the limits allow, sent at once, then a plain chat: it finishes within
    GRAMMAR_STALL_BOUND_S of its time alone (they would hold the tokenizer worker's loop ~0.5 s each if it parsed
    them); a schema too deep or a grammar too large is a 400 naming the limit."""
    alone = min(chat_seconds(server)[0] for _ in range(3))
    with ThreadPoolExecutor(4) as pool:
        heavy = [pool.submit(chat_seconds, server, response_format=wide_format(i)) for i in range(4)]
        time.sleep(0.1)  # the heavy requests are in first
        beside, resp = chat_seconds(server)
        results = [f.result() for f in heavy]
    print(f"plain chat alone {alone:.2f} s, beside 4 heavy schemas {beside:.2f} s (they took "
          f"{', '.join(f'{t:.2f}' for t, _ in results)} s)")
    assert resp.status_code == 200 and all(r.status_code == 200 for _, r in results), results
    assert beside < alone + GRAMMAR_STALL_BOUND_S
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(nested_schema(40))}}
    _, resp = chat_seconds(server, response_format=deep)
    assert resp.status_code == 400 and "MAX_JSON_SCHEMA_DEPTH" in resp.json()["error"]["message"]
    resp = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                                          "regex": "a" * (MAX_GRAMMAR_BYTES + 1)})
    assert resp.status_code == 400 and "MAX_GRAMMAR_BYTES" in resp.text
    assert server.state()["integrity"] == "ok"
