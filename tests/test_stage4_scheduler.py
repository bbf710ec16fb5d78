"""Stage 4's lessons: continuous batching over a paged KV pool changes no token — with requests arriving over time,
chunked prefill, preemption, priorities — and the pool never leaks a page."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from common.admission import without_look_ahead
from stage4_scheduler import LLM, SamplingParams


def mixed(n: int, seed: int, max_out: int = 24):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.choice([1, 3, 17, 40, 90]))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, max_out), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def path(tiny_llama_path):
    return str(tiny_llama_path)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, attention_backend="torch")


@pytest.fixture(scope="module")
def alone(llm):
    """Each request's tokens when it runs alone (memoised)."""
    cache = {}

    def run(prompt, params):
        key = (tuple(prompt), params.max_new_tokens)
        if key not in cache:
            cache[key] = llm.generate([prompt], params)[0].token_ids
        return cache[key]

    return run


def assert_clean(llm):
    sched = llm.scheduler
    sched.check_integrity()
    assert sched.cache.num_used_pages == 0 and not sched.has_unfinished(), "pages or requests left behind"


def test_64_requests_arriving_over_time_match_alone(llm, alone):
    prompts, params = mixed(64, seed=0)
    rids, out, done = {}, {}, set()
    arrivals = iter(range(64))
    steps = 0
    while len(done) < 64:
        if steps % 3 == 0:  # a few new requests every third step, while the others run
            for _ in range(4):
                i = next(arrivals, None)
                if i is not None:
                    rids[llm.add_request(prompts[i], params[i])] = i
        for o in llm.step():
            out.setdefault(rids[o.rid], []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == "length"
                done.add(rids[o.rid])
        llm.scheduler.check_integrity()
        steps += 1
    for i in range(64):
        assert out[i] == alone(prompts[i], params[i]), f"request {i}"
    assert_clean(llm)


def test_tiny_pool_forces_preemption_and_changes_nothing(path, alone):
    prompts, params = mixed(16, seed=1, max_out=30)
    # 40 pages of 4 tokens, and admission without look-ahead: the scheduler overcommits and must preempt.
    small = without_look_ahead(LLM(path, attention_backend="torch", max_total_tokens=160, page_size=4))
    assert small.engine.kv_pool.num_pages == 40
    results = small.generate(prompts, params)
    for prompt, p, r in zip(prompts, params, results):
        assert r.token_ids == alone(prompt, p)
    assert small.scheduler.total_preemptions > 0, "the pool was meant to be too small for all 16 at once"
    assert_clean(small)


def test_chunked_prefill_changes_nothing(path, alone):
    prompts, params = mixed(12, seed=2)
    chunky = LLM(path, attention_backend="torch", chunked_prefill_size=7, page_size=4, record_stats=True)
    results = chunky.generate(prompts, params)
    assert [r.token_ids for r in results] == [alone(p, sp) for p, sp in zip(prompts, params)]
    prefills = [s for s in chunky.scheduler.stats if s.phase == "prefill"]
    assert max(s.num_tokens for s in prefills) == 7, "no prefill batch goes past chunked_prefill_size"
    assert any(s.batch_size > 1 for s in prefills), "short prompts share a batch with the end of a chunked one"
    assert_clean(chunky)


def test_max_prefill_tokens_without_chunking_keeps_prompts_whole(path, alone):
    prompts, params = mixed(12, seed=2)
    whole = LLM(path, attention_backend="torch", chunked_prefill_size=-1, max_prefill_tokens=20, page_size=4,
                record_stats=True)
    results = whole.generate(prompts, params)
    assert [r.token_ids for r in results] == [alone(p, sp) for p, sp in zip(prompts, params)]
    prefills = [s for s in whole.scheduler.stats if s.phase == "prefill"]
    # A 90-token prompt goes in one pass, alone (the first of a batch may exceed the budget); no chunk ever.
    assert max(s.num_tokens for s in prefills) == max(map(len, prompts)) == 90
    assert all(s.num_tokens <= 20 or s.batch_size == 1 for s in prefills)
    assert_clean(whole)


def test_admission_look_ahead_preempts_less_and_changes_nothing(path):
    """new_token_ratio: admitting a request only when the pool can also hold the outputs it and the running
    requests are expected to produce cuts preemptions (and the recompute they cost); tokens are the same."""
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(4, 40))] for _ in range(32)]
    params = [SamplingParams(max_new_tokens=rng.randint(8, 48), ignore_eos=True) for _ in range(32)]
    runs = {}
    for look_ahead in (False, True):
        llm = LLM(path, attention_backend="torch", max_total_tokens=240, page_size=4, record_stats=True)
        llm = llm if look_ahead else without_look_ahead(llm)
        runs[look_ahead] = ([r.token_ids for r in llm.generate(prompts, params)], llm.scheduler.total_preemptions,
                            sum(s.num_tokens for s in llm.scheduler.stats))
        assert_clean(llm)
    (ids_old, preempt_old, computed_old), (ids_new, preempt_new, computed_new) = runs[False], runs[True]
    assert ids_new == ids_old
    assert preempt_old >= 10 and preempt_new <= preempt_old // 5, (preempt_old, preempt_new)
    assert computed_new < computed_old, "fewer preemptions: fewer tokens recomputed"


def test_new_token_ratio_decays_and_resets_on_preemption(path):
    assert LLM(path, attention_backend="torch", verbose=False).scheduler.new_token_ratio == pytest.approx(0.7)
    # A bold scheduler (ratio 0.07) so that it overcommits the 64-token pool and must preempt.
    llm = LLM(path, attention_backend="torch", max_total_tokens=64, page_size=4, schedule_conservativeness=0.1)
    sched = llm.scheduler
    assert sched.new_token_ratio == pytest.approx(0.07) and sched.min_new_token_ratio == pytest.approx(0.0098)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        llm.add_request(prompt, params)
    ratios, preempted_at = [], None
    while llm.has_unfinished_requests():
        before = sched.total_preemptions
        llm.step()
        ratios.append(sched.new_token_ratio)
        if sched.total_preemptions > before and preempted_at is None:
            preempted_at = len(ratios) - 1
    assert preempted_at is not None, "three 43-token requests cannot all fit 64 tokens"
    assert ratios[preempted_at - 1] < 0.07, "the ratio decays while decoding goes well"
    assert ratios[preempted_at] > ratios[preempted_at - 1], "a preemption raises it again"
    assert_clean(llm)


def test_stream_closed_early_aborts_its_requests(llm):
    gen = llm.stream([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=50, ignore_eos=True))
    first = [next(gen), next(gen)]
    assert not any(c.finished for c in first) and llm.has_unfinished_requests()
    gen.close()  # what a `break` out of the loop does once the generator is dropped
    assert not llm.has_unfinished_requests()
    assert_clean(llm)
    for chunk in llm.stream([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True)):
        if chunk.token_ids:
            break  # the same through a plain break
    assert not llm.has_unfinished_requests()
    assert_clean(llm)


def test_priority_runs_first_and_low_priority_is_not_starved(path):
    llm = LLM(path, attention_backend="torch", max_running_requests=1)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    low = llm.add_request([5, 6, 7], params, priority=0)
    high = llm.add_request([8, 9], params, priority=5)
    finished = []
    while llm.has_unfinished_requests():
        finished += [o.rid for o in llm.step() if o.finished]
    assert finished == [high, low]  # arrived later, ran first

    llm.scheduler.priority_aging_steps = 4
    starving = llm.add_request([1, 2, 3], params, priority=0)
    done, steps = set(), 0
    while starving not in done:
        llm.add_request([4], params, priority=2)  # a steady stream of higher-priority work
        done |= {o.rid for o in llm.step() if o.finished}
        steps += 1
        assert steps < 200, "a low-priority request starved"
    while llm.has_unfinished_requests():
        llm.step()
    assert_clean(llm)


def test_stop_conditions(llm):
    prompt = [11, 12, 13, 14]
    (free,) = llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert free.finish_reason == "length" and free.completion_tokens == 20 and free.prompt_tokens == 4
    # stop_token_ids
    tok = free.token_ids[5]
    (r,) = llm.generate([prompt], SamplingParams(max_new_tokens=20, stop_token_ids=[tok]))
    assert r.token_ids == free.token_ids[: free.token_ids.index(tok) + 1] and r.matched_stop == tok
    # several EOS ids (as from generation_config.json lists)
    saved = set(llm.engine.eos_token_ids)
    llm.engine.eos_token_ids = {free.token_ids[7], 10**6}
    try:
        (r,) = llm.generate([prompt], SamplingParams(max_new_tokens=20))
        assert r.finish_reason == "stop" and r.token_ids[-1] == free.token_ids[7]
        (r,) = llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
        assert r.token_ids == free.token_ids
    finally:
        llm.engine.eos_token_ids = saved


def test_stop_string_spanning_tokens_is_trimmed(llm):
    prompt = [21, 22, 23]
    (free,) = llm.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
    tok = llm.tokenizer
    pieces = [tok.decode(free.token_ids[: i + 1], skip_special_tokens=True) for i in range(len(free.token_ids))]
    # a stop string made of the end of token 5's text and the start of token 6's: it spans a token boundary
    cut = len(pieces[4])
    text = free.text
    stop = text[max(0, cut - 2) : cut + 2]
    assert len(stop) >= 2 and text.find(stop) == max(0, cut - 2), "pick a stop string that first appears there"
    (r,) = llm.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True, stop=[stop, "never-seen"]))
    assert r.finish_reason == "stop" and r.matched_stop == stop
    assert r.text == text[: text.find(stop)]
    assert len(r.token_ids) <= 7


def test_detokenizer_never_splits_a_character(llm):
    from stage4_scheduler.detokenizer import IncrementalDetokenizer

    text = "长城是中国古代的伟大建筑，全长两万多公里。🌍 Hello, 世界! naïve café"
    ids = llm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(llm.tokenizer)
    deltas = []
    for t in ids:
        detok.add(t)
        deltas.append(detok.take_delta())
    assert "".join(deltas) + detok.take_delta(final=True) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas, "some character spans several tokens: its first tokens must yield nothing"


def test_streaming_deltas_add_up_to_the_text(smollm2_path):
    llm = LLM(str(smollm2_path))
    prompt = llm.apply_chat_template("用中文介绍一下长城。")
    chunks = list(llm.stream([prompt, "The Great Wall"], SamplingParams(max_new_tokens=40)))
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        ids = [t for c in mine for t in c.token_ids]
        assert mine[-1].finished and sum(c.finished for c in mine) == 1
        assert "".join(c.text for c in mine) == llm.tokenizer.decode(ids, skip_special_tokens=True)
        # only a request that ends inside a character may show U+FFFD, and only in its final chunk
        assert all("\ufffd" not in c.text for c in mine[:-1])
    assert_clean(llm)


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    for kwargs, field in [({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"),
                          ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    good = SamplingParams(max_new_tokens=4, ignore_eos=True)
    bad = SamplingParams(max_new_tokens=4)
    bad.top_p = 7.0  # mutated after construction: caught when the request is added
    results = llm.generate(["Hello", "", "World", [1] * 10**5, "Again"], [good, good, bad, good, good])
    assert [r.finish_reason for r in results] == ["length", "error", "error", "error", "length"]
    assert "top_p" in results[2].error and "context" in results[3].error
    with pytest.raises(ValueError, match="priority"):
        llm.add_request("x", good, priority="high")
    assert_clean(llm)
    assert llm.generate(["Hello"], good)[0].token_ids == results[0].token_ids


def test_abort(llm):
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    a = llm.add_request([1, 2, 3], params)
    b = llm.add_request([4, 5, 6], params)
    llm.step()
    llm.step()
    llm.scheduler.abort(a)
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.rid: o.finish_reason for o in llm.step() if o.finished})
    assert finished == {b: "length"}
    assert_clean(llm)


def test_command_line(path):
    out = subprocess.run([sys.executable, "-m", "stage4_scheduler", "--model", path, "--no-chat",
                          "--prompt", "Hello", "--prompt", "Bonjour", "--max-new-tokens", "4", "--ignore-eos",
                          "--stream", "--max-total-tokens", "4096"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 requests, 8 tokens" in out.stdout and "KV pool 4096 tokens (256 pages of 16)" in out.stdout
    assert "KV pool 4096 tokens" in out.stderr, "the load line reports the pool's token capacity"


def test_kv_pool_is_sized_from_memory(monkeypatch):
    import torch

    from stage4_scheduler import engine

    cpu, per_token = torch.device("cpu"), 1536
    plan = engine.plan_kv_pool(cpu, per_token, 16, max_total_tokens=1000, mem_fraction_static=None,
                               max_tokens_needed=10**9)
    assert (plan.num_pages, plan.max_total_tokens) == (62, 992)  # whole pages only
    monkeypatch.setattr(engine, "available_ram_bytes", lambda: 2 << 30)  # 2 GiB available
    plan = engine.plan_kv_pool(cpu, per_token, 16, None, None, max_tokens_needed=10**9)
    assert plan.max_total_tokens == (512 << 20) // per_token // 16 * 16  # a quarter of 2 GiB
    monkeypatch.setattr(engine, "available_ram_bytes", lambda: 64 << 30)
    plan = engine.plan_kv_pool(cpu, per_token, 16, None, None, max_tokens_needed=10**9)
    assert plan.max_total_tokens == (1 << 30) // per_token // 16 * 16  # capped at 1 GiB
    plan = engine.plan_kv_pool(cpu, per_token, 16, None, None, max_tokens_needed=4096)
    assert plan.max_total_tokens == 4096 and "max_running_requests" in plan.reason  # no more than usable
    # CUDA: weights + KV within mem_fraction_static of the device, measured after the weights are loaded.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 << 30, 80 << 30))
    plan = engine.plan_kv_pool(torch.device("cuda"), per_token, 16, None, 0.9, max_tokens_needed=10**9)
    assert plan.max_total_tokens == int((50 << 30) - (80 << 30) * (1 - 0.9)) // per_token // 16 * 16
    with pytest.raises(ValueError, match="mem_fraction_static"):
        engine.plan_kv_pool(torch.device("cuda"), per_token, 16, None, 0.3, max_tokens_needed=10**9)


def test_bad_pool_settings_are_refused(path):
    for kwargs, word in [({"max_total_tokens": 3, "page_size": 4}, "max_total_tokens"),
                         ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
                         ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
                         ({"max_prefill_tokens": 0}, "max_prefill_tokens"),
                         ({"schedule_conservativeness": -1}, "schedule_conservativeness")]:
        with pytest.raises(ValueError, match=word):
            LLM(path, attention_backend="torch", verbose=False, **kwargs)
