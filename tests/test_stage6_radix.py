"""Stage 6's lesson: the prefix cache computes a shared prefix once and changes no token.

Every workload here runs with the cache on and off and must give the same tokens; the pool's books (free / in the
tree / private, locks == users) are checked after every step, and once idle, free + evictable + protected == total.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

import stage6_radix.graph as graph_module
from common import graph_emulator
from common.admission import without_look_ahead
from stage6_radix import LLM, SamplingParams


@pytest.fixture(scope="module")
def path(tiny_llama_path):
    return str(tiny_llama_path)


def shared_prefix_workload(n: int, seed: int, prefix_len: int = 48, max_out: int = 12):
    """n prompts: one of three shared prefixes + a short own suffix, as with system prompts or few-shot examples."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 12))]
               for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, max_out), ignore_eos=True) for _ in range(n)]
    return prompts, params


def assert_idle_books(llm):
    """Idle: no request holds anything, so every page is free or an unlocked (evictable) tree page."""
    sched, cache = llm.scheduler, llm.scheduler.cache
    sched.check_integrity()
    assert not sched.has_unfinished() and not sched.inflight and not sched.deferred
    tree = cache.tree
    protected = tree.protected_size // cache.page_size if tree else 0
    assert protected == 0
    assert cache.num_free_pages + cache.num_evictable_pages + protected == cache.pool.num_pages
    return cache


def assert_no_leak(llm):
    """Once the tree is emptied too, every page is back on the free list."""
    cache = assert_idle_books(llm)
    llm.scheduler.flush_cache()
    llm.scheduler.check_integrity()
    assert cache.num_free_pages == cache.pool.num_pages


def run_arriving(llm, prompts, params, every=2, per=3):
    """Requests arrive a few at a time while others run; the books are checked after every step."""
    rids, out = {}, {}
    arrivals = iter(range(len(prompts)))
    step = 0
    while len(out) < len(prompts) or llm.has_unfinished_requests():
        if step % every == 0:
            for _ in range(per):
                i = next(arrivals, None)
                if i is not None:
                    rids[llm.add_request(prompts[i], params[i])] = i
                    out[i] = []
        for o in llm.step():
            out[rids[o.rid]].extend(o.new_token_ids)
        llm.scheduler.check_integrity()
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("page_size, shared_pages", [(16, 5), (4, 20), (1, 70)])
def test_cascade_decode_equals_the_padded_reference(page_size, shared_pages):
    """A decode batch whose requests all start in the same pages reads them once (decode_cascade) and gives what
    attending each request's whole context gives: lengths from one own key (a request whose prefix is exactly the
    shared pages) to 120 past it, one request far longer than the rest."""
    from test_stage4_attention import padded_reference, random_layout

    from stage6_radix.attention.torch_backend import CASCADE_MIN_SHARED_TOKENS, TorchBackend

    shared = shared_pages * page_size
    reqs = [(shared, 1), (shared + 3, 1), (shared + 17, 1), (shared + 40, 1), (shared + 120, 1), (3 * shared, 1)]
    q, k, v, kc, vc, fb = random_layout(reqs, 6, 2, 16, page_size, "decode", shared_pages=shared_pages, seed=4)
    backend = TorchBackend()
    backend.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert shared >= CASCADE_MIN_SHARED_TOKENS and meta.shared_kv_indices is not None
    assert len(meta.shared_kv_indices) == shared  # every shared page, and nothing a request owns
    out = backend.decode(q, kc, vc, fb, 0.25)
    torch.testing.assert_close(out, padded_reference(q, k, v, kc, vc, fb, 0.25), rtol=1e-5, atol=1e-5)


def test_cascade_needs_pages_that_every_request_shares():
    from test_stage4_attention import random_layout

    from stage6_radix.attention.torch_backend import TorchBackend

    backend = TorchBackend()
    for shared_pages, reqs in ((0, [(100, 1), (120, 1)]),  # long requests, nothing shared
                               (3, [(48, 1), (60, 1)]),  # shared, but shorter than worth it (48 < 64 tokens)
                               (6, [(96, 1)])):  # one request: nothing to share with
        *_, fb = random_layout(reqs, 6, 2, 16, 16, "decode", shared_pages=shared_pages, seed=5)
        backend.init_forward_metadata(fb)
        assert fb.attn_metadata.shared_kv_indices is None, (shared_pages, reqs)


def test_engine_decodes_a_shared_system_prompt_by_cascade_with_the_tokens_of_no_cache(path, monkeypatch):
    from stage6_radix.attention.torch_backend import TorchBackend

    calls = []
    cascade = TorchBackend.decode_cascade
    monkeypatch.setattr(TorchBackend, "decode_cascade", lambda self, *a: calls.append(1) or cascade(self, *a))
    prompts, params = shared_prefix_workload(16, seed=7, prefix_len=100, max_out=16)
    prompts = [prompts[0][:100] + p[100:] for p in prompts]  # one system prompt for all
    off = LLM(path, attention_backend="torch", disable_radix_cache=True, verbose=False)
    want = [r.token_ids for r in off.generate(prompts, params)]
    assert not calls, "without the cache no two requests share a page"
    llm = LLM(path, attention_backend="torch", verbose=False)
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    assert calls, "the shared system prompt was read once per decode step"
    assert_no_leak(llm)


def test_second_run_hits_the_cache_with_identical_tokens(path):
    prompts, params = shared_prefix_workload(12, seed=0)
    off = LLM(path, attention_backend="torch", disable_radix_cache=True, verbose=False)
    want = [r.token_ids for r in off.generate(prompts, params)]
    llm = LLM(path, attention_backend="torch", page_size=4, verbose=False)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second] == want
    # Second time round every prompt is in the tree: all of it but the last token (whole pages of 4) is reused.
    for prompt, r in zip(prompts, second):
        assert r.cached_tokens == (len(prompt) - 1) // 4 * 4
    assert sum(r.cached_tokens for r in first) > 0, "the shared prefixes hit within the first run already"
    assert all(r.cached_tokens == 0 for r in off.generate(prompts, params))
    assert_no_leak(llm)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefixes_arriving_over_time(path, page_size, overlap):
    prompts, params = shared_prefix_workload(24, seed=1)
    want = run_arriving(LLM(path, attention_backend="torch", disable_radix_cache=True, verbose=False), prompts,
                        params)
    llm = LLM(path, attention_backend="torch", page_size=page_size, disable_overlap=not overlap, verbose=False)
    assert run_arriving(llm, prompts, params) == want
    assert llm.scheduler.cache_hit_rate > 0.5
    assert_no_leak(llm)


def test_identical_prompts_in_one_batch_and_prompts_that_prefix_each_other(path):
    rng = random.Random(2)
    base = [rng.randrange(100, 40000) for _ in range(37)]
    prompts = [base, base, base[:20], base[:20] + [7, 8, 9], base + [11] * 9, base[:1], base]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 6, 3, 9, 4, 5, 6)]
    want = [r.token_ids for r in LLM(path, attention_backend="torch", disable_radix_cache=True,
                                     verbose=False).generate(prompts, params)]
    for page_size in (1, 4):
        llm = LLM(path, attention_backend="torch", page_size=page_size, verbose=False)
        assert [r.token_ids for r in llm.generate(prompts, params)] == want  # all admitted in one batch
        assert [r.token_ids for r in llm.generate(prompts, params)] == want  # now from the cache
        assert_no_leak(llm)


def test_a_prefix_still_being_chunk_prefilled_is_shared(path):
    """A long prompt computed in chunks puts each chunk in the tree at once: a request with the same prefix that
    arrives meanwhile reuses what is done instead of computing it a second time."""
    rng = random.Random(3)
    prefix = [rng.randrange(100, 40000) for _ in range(200)]
    a, b = prefix + [5, 6, 7], prefix + [8, 9]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = [r.token_ids for r in LLM(path, attention_backend="torch", disable_radix_cache=True,
                                     verbose=False).generate([a, b], params)]
    llm = LLM(path, attention_backend="torch", page_size=4, chunked_prefill_size=32, record_stats=True,
              disable_overlap=True, verbose=False)
    out = {llm.add_request(a, params): []}
    for _ in range(3):  # three chunks of a's prompt
        llm.step()
    rid_b = llm.add_request(b, params)
    out[rid_b], reqs = [], {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            out[o.rid].extend(o.new_token_ids)
            reqs[o.rid] = o.req
        llm.scheduler.check_integrity()
    assert list(out.values()) == want
    assert reqs[rid_b].cached_tokens >= 3 * 32, "b reuses the chunks a had finished when b arrived"
    computed = sum(s.num_tokens for s in llm.scheduler.stats if s.phase == "prefill")
    assert computed < len(a) + len(b) - 3 * 32, f"b recomputed a's finished chunks ({computed} prefill tokens)"
    assert_no_leak(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_pool_evicts_the_tree_first_and_preempts_when_it_must(path, overlap):
    prompts, params = shared_prefix_workload(20, seed=4, prefix_len=40, max_out=30)
    want = [r.token_ids for r in LLM(path, attention_backend="torch", disable_radix_cache=True,
                                     verbose=False).generate(prompts, params)]
    # 48 pages of 4 tokens and admission without look-ahead: the tree must give pages back, and decode must preempt.
    llm = without_look_ahead(LLM(path, attention_backend="torch", page_size=4, max_total_tokens=192,
                                 disable_overlap=not overlap, verbose=False))
    evicted = []
    real_evict = llm.scheduler.cache.tree.evict
    llm.scheduler.cache.tree.evict = lambda n: evicted.append(n) or real_evict(n)
    assert run_arriving(llm, prompts, params, every=1, per=2) == want
    assert evicted, "the pool was meant to be too small to keep every prefix"
    assert llm.scheduler.total_preemptions > 0, "the pool was meant to be too small for every request at once"
    assert llm.scheduler.cache_hit_rate > 0
    assert_no_leak(llm)


def test_preempted_request_recomputes_from_the_cache(path):
    """Preemption puts the victim's computed pages in the tree: its recompute is mostly a cache hit."""
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(30)] for _ in range(6)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [r.token_ids for r in LLM(path, attention_backend="torch", disable_radix_cache=True,
                                     verbose=False).generate(prompts, params)]
    llm = without_look_ahead(LLM(path, attention_backend="torch", page_size=4, max_total_tokens=160,
                                 record_stats=True, verbose=False))
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    assert llm.scheduler.total_preemptions > 0
    assert llm.scheduler.cached_tokens > 0, "a recompute found its own pages in the tree"
    assert_no_leak(llm)


def test_abort_puts_the_computed_pages_in_the_tree(path):
    llm = LLM(path, attention_backend="torch", page_size=4, verbose=False)
    prompt = list(range(1000, 1030))
    rid = llm.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(4):
        llm.step()
    llm.abort_request(rid)
    llm.scheduler.check_integrity()
    (again,) = llm.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert again.cached_tokens == 28  # the aborted request's prompt pages were kept
    assert_no_leak(llm)


def test_cache_aware_order_raises_the_hit_rate(path):
    """Longest-prefix-match ordering runs requests that share a cached prefix together, while it is cached."""
    rng = random.Random(6)
    groups = [[rng.randrange(100, 40000) for _ in range(60)] for _ in range(6)]
    prompts = [groups[i % 6] + [rng.randrange(100, 40000) for _ in range(3)] for i in range(36)]  # interleaved
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    rates, tokens = {}, {}
    for policy in ("fcfs", "lpm"):
        # a pool that holds about two groups' prefixes: order decides what is still cached when a request comes
        llm = LLM(path, attention_backend="torch", page_size=4, max_total_tokens=320, max_running_requests=4,
                  schedule_policy=policy, verbose=False)
        tokens[policy] = [r.token_ids for r in llm.generate(prompts, params)]
        rates[policy] = llm.scheduler.cache_hit_rate
        assert_no_leak(llm)
    assert tokens["lpm"] == tokens["fcfs"]
    assert rates["lpm"] > rates["fcfs"] + 0.1, rates


def test_emulated_graphs_with_the_prefix_cache(path, monkeypatch):
    prompts, params = shared_prefix_workload(16, seed=7)
    want = run_arriving(LLM(path, attention_backend="torch", disable_radix_cache=True, verbose=False), prompts,
                        params)
    monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    llm = LLM(path, attention_backend="torch", page_size=4, cuda_graph_max_bs=8, verbose=False)
    assert run_arriving(llm, prompts, params) == want
    assert llm.engine.num_graph_replays > 0 and llm.scheduler.cache_hit_rate > 0.5
    assert_no_leak(llm)


def test_disable_radix_cache_is_stage_5(path):
    prompts, params = shared_prefix_workload(8, seed=8)
    llm = LLM(path, attention_backend="torch", disable_radix_cache=True, verbose=False)
    results = llm.generate(prompts, params)
    assert llm.scheduler.cache.tree is None and llm.scheduler.cache_hit_rate == 0
    assert all(r.cached_tokens == 0 for r in results)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="schedule_policy"):
        LLM(path, attention_backend="torch", schedule_policy="random", verbose=False)


def test_command_line(path):
    out = subprocess.run([sys.executable, "-m", "stage6_radix", "--model", path, "--no-chat",
                          "--prompt", "The lighthouse keeper wrote in his log every evening about the sea",
                          "--prompt", "The lighthouse keeper wrote in his log every evening about the ships",
                          "--max-new-tokens", "4", "--ignore-eos", "--page-size", "4", "--max-total-tokens", "4096",
                          "--schedule-policy", "fcfs"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 requests, 8 tokens" in out.stdout and "prefix cache on" in out.stdout


def test_bench_radix_on_a_random_shape_runs_on_a_cpu(capsys):
    """The radix benchmark as common/gpu_check.sh runs it (random weights of a given shape), rehearsed with the tiny
    shape in float32: the cache finds the shared prompt and changes no token."""
    import re

    from common.bench import main

    main(["radix", "--shape", "tiny", "--workloads", "shared", "random"])
    out = capsys.readouterr().out
    assert out.count("radix == no cache: True") == 2, out
    hit = re.search(r"shared\s+radix\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+(\d+)%", out)
    assert hit and int(hit.group(1)) >= 80, out  # ~512 of each ~550-token prompt is the shared system prompt


def test_fcfs_keeps_arrival_order_when_prompts_share_a_prefix_in_one_batch(path):
    """Two new prompts of one batch that share 48 tokens: the cache-aware order (lpm) lets the second wait one
    step for the first's pages; fcfs admits them in the order they came, as first come first served says."""
    rng = random.Random(9)
    prefix = [rng.randrange(100, 40000) for _ in range(48)]
    prompts = [prefix + [1, 2], prefix + [3, 4], [rng.randrange(100, 40000) for _ in range(20)]]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for policy, first_batch in (("fcfs", [0, 1, 2]), ("lpm", [0, 2])):
        llm = LLM(path, attention_backend="torch", page_size=4, schedule_policy=policy, disable_overlap=True,
                  verbose=False)
        rids = [llm.add_request(p, params) for p in prompts]
        llm.step()
        assert [r.rid for r in llm.scheduler.decoder.running] == [rids[i] for i in first_batch], policy
        while llm.has_unfinished_requests():
            llm.step()
        assert_no_leak(llm)


def count_calls(obj, name: str) -> list:
    calls, real = [], getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(obj.step_count)
        return real(*args, **kwargs)
    setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("limit", ["rows", "pages"])
def test_the_waiting_queue_is_ordered_only_when_a_prefill_can_be_built(path, limit):
    """Ordering the queue walks the tree once per waiting request: a step that cannot admit anyone (every
    page-table row taken, or the head of the queue waiting for pages nobody gave back yet) does not order it."""
    prompts, params = shared_prefix_workload(6, seed=10, max_out=16)
    want = [r.token_ids for r in LLM(path, attention_backend="torch", disable_radix_cache=True,
                                     verbose=False).generate(prompts, params)]
    options = dict(max_running_requests=2) if limit == "rows" else dict(max_total_tokens=128)
    llm = LLM(path, attention_backend="torch", page_size=4, record_stats=True, disable_overlap=True,
              verbose=False, **options)
    sorts = count_calls(llm.scheduler, "sort_waiting")
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    prefills = [s.step for s in llm.scheduler.stats if s.phase == "prefill"]
    # Every ordering led to a prefill, or (pages) to the one attempt that found the pool full, after which the
    # queue waits for a request to finish: never one per decode step.
    assert len(llm.scheduler.stats) > 2 * len(sorts), (len(llm.scheduler.stats), len(sorts))
    if limit == "rows":
        assert sorts == prefills
    else:
        assert set(prefills) <= set(sorts) and len(sorts) <= len(prefills) + len(prompts)
    assert_no_leak(llm)
