"""Stage 4's exercises: page allocation, reading keys through the page table, admission, preemption.

Run them with `python -m common.exercises check 4` (your copy) or `check 4 --reference`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

STAGE = "stage4_scheduler"


def cache_manager(stage, num_pages=8, page_size=4, rows=4):
    pool = stage.kv_cache.PagedKVPool(1, num_pages, page_size, 1, 2, torch.float32, "cpu")
    table = stage.kv_cache.PageTable(rows, 16, "cpu")
    return stage.scheduler.cache_manager.CacheManager(pool, table)


def req(stage, rid, prompt_len, max_new_tokens=8, arrival=0):
    params = stage.core.SamplingParams(max_new_tokens=max_new_tokens)
    r = stage.core.Req(rid, list(range(100, 100 + prompt_len)), params)
    r.arrival = arrival
    return r


@pytest.mark.task("4.page_allocation")
def test_grow_hands_out_whole_pages_all_or_nothing(stage):
    cm = cache_manager(stage)
    r = req(stage, 0, 5)
    cm.acquire_row(r)
    assert cm.grow(r, 5) and cm.req_pages[0] == [0, 1], "5 tokens: 2 pages of 4, page 0 first"
    assert cm.grow(r, 8) and cm.req_pages[0] == [0, 1], "8 tokens still fit in 2 pages"
    assert cm.grow(r, 9) and len(cm.req_pages[0]) == 3 and cm.num_free_pages == 5
    assert cm.page_table.table[r.table_idx, :3].tolist() == cm.req_pages[0], "the page table row"
    assert not cm.grow(r, 40), "40 tokens need 10 pages: more than the pool has"
    assert len(cm.req_pages[0]) == 3 and cm.num_free_pages == 5, "a failed grow changes nothing"
    cm.check_integrity([])


@pytest.mark.task("4.page_allocation")
def test_slots_follow_each_request_pages(stage):
    cm = cache_manager(stage)
    a, b = req(stage, 0, 4), req(stage, 1, 4)
    for r in (a, b):
        cm.acquire_row(r)
    assert cm.grow(a, 4) and cm.grow(b, 4) and cm.grow(a, 6)  # a: pages 0 and 2, b: page 1
    assert cm.req_pages[0] == [0, 2] and cm.req_pages[1] == [1]
    assert cm.slots(a, 0, 6) == [0, 1, 2, 3, 8, 9]  # page * page_size + offset
    assert cm.slots(a, 5, 6) == [9] and cm.slots(b, 1, 3) == [5, 6]
    cm.release(a)
    assert cm.grow(b, 12) and cm.req_pages[1] == [1, 0, 2], "freed pages are reused"
    cm.check_integrity([])


def paged_batch(stage, cm, reqs):
    seq_lens = [r.device_len for r in reqs]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return SimpleNamespace(seq_lens_cpu=seq_lens, seq_lens=lens,
                           page_size=cm.page_size, batch_size=len(reqs),
                           page_table=cm.page_table.table,
                           req_rows=torch.tensor([r.table_idx for r in reqs], dtype=torch.int32))


@pytest.mark.task("4.kv_indices")
def test_kv_indices_read_each_key_through_the_page_table(stage):
    cm = cache_manager(stage, num_pages=16)
    a, b, c = req(stage, 0, 6), req(stage, 1, 3), req(stage, 2, 9)
    for r in (a, b, c):
        cm.acquire_row(r)
    for r, n in [(a, 4), (b, 3), (c, 4), (a, 6), (c, 9)]:  # interleaved: pages not contiguous
        assert cm.grow(r, n)
    fb = paged_batch(stage, cm, [c, a, b])
    indptr, indices = stage.attention.torch_backend.build_kv_indices(fb)
    assert indptr == [0, 9, 15, 18]
    assert indices.dtype == torch.int64
    assert indices.tolist() == cm.slots(c, 0, 9) + cm.slots(a, 0, 6) + cm.slots(b, 0, 3)


@pytest.mark.task("4.prefill_adder")
def test_adder_cuts_the_request_that_crosses_the_chunk_budget(stage):
    cm = cache_manager(stage, num_pages=64)
    adder = stage.scheduler.prefill.PrefillAdder(cm, max_prefill_tokens=100, chunked_prefill_size=8)
    r0, r1, r2 = req(stage, 0, 5), req(stage, 1, 6), req(stage, 2, 2)
    batch, admitted = adder.build(None, [r0, r1, r2], [], 0.5, 1000)
    assert batch.reqs == [r0, r1] and admitted == [r0, r1], "r1 is cut at the budget; r2 waits"
    assert (r0.extend_len, r1.extend_len) == (5, 3)
    assert all(r.status is stage.core.ReqStatus.RUNNING and r.table_idx >= 0 for r in (r0, r1))
    assert batch.phase == "prefill"
    assert batch.out_cache_loc == cm.slots(r0, 0, 5) + cm.slots(r1, 0, 3)
    r0.complete_one(1)
    r1.complete_chunk()  # the step ran: r1 is the chunked request now
    batch, admitted = adder.build(r1, [r2], [r0], 0.5, 1000)
    assert batch.reqs == [r1, r2] and admitted == [r2], "the chunked request continues first"
    assert (r1.cached_len, r1.extend_len, r2.extend_len) == (3, 3, 2)
    cm.check_integrity([r0])


@pytest.mark.task("4.prefill_adder")
def test_adder_keeps_room_for_what_requests_will_generate(stage):
    cm = cache_manager(stage, num_pages=8)  # 32 tokens
    adder = stage.scheduler.prefill.PrefillAdder(cm, max_prefill_tokens=100)
    r0, r1 = req(stage, 0, 8, max_new_tokens=8), req(stage, 1, 8, max_new_tokens=16)
    r2 = req(stage, 2, 1)
    batch, admitted = adder.build(None, [r0, r1, r2], [], 0.5, 1000)
    # r0 takes 2 pages and is promised 2 more for its 8 new tokens; r1 would need 6 of the 4 left:
    # it waits, and r2 behind it too (it must not overtake the head of the queue forever).
    assert admitted == [r0] and batch.reqs == [r0] and cm.num_free_pages == 6
    assert r1.status is stage.core.ReqStatus.WAITING and r1.table_idx == -1


@pytest.mark.task("4.prefill_adder")
@pytest.mark.parametrize("ratio, admits", [(0.5, True), (1.0, False)])
def test_adder_reserves_pages_for_the_running_by_new_token_ratio(stage, ratio, admits):
    cm = cache_manager(stage, num_pages=8)
    adder = stage.scheduler.prefill.PrefillAdder(cm, max_prefill_tokens=100)
    running = req(stage, 0, 4, max_new_tokens=21)
    cm.acquire_row(running)
    assert cm.grow(running, 4)
    running.status = stage.core.ReqStatus.RUNNING
    running.complete_one(7)  # 20 tokens left: 0.5 -> 10 expected, 3 pages more; 1.0 -> 20, 5 more
    new = req(stage, 1, 8, max_new_tokens=8)  # 4 pages: 7 free minus what the running one may use
    batch, admitted = adder.build(None, [new], [running], ratio, 1000)
    assert (admitted == [new]) == admits and (batch is not None) == admits


def roomy_llm(stage, path):
    return stage.LLM(str(path), attention_backend="torch", page_size=2, max_total_tokens=512,
                     verbose=False)


def decode_manager(stage, cm, reqs):
    dm = stage.scheduler.decode.DecodeManager(cm)
    for r in reqs:  # each prefilled: one page of 4 prompt tokens, its first token sampled
        cm.acquire_row(r)
        assert cm.grow(r, 4)
        r.status = stage.core.ReqStatus.RUNNING
        r.complete_one(1)
        dm.add(r)
    return dm


@pytest.mark.task("4.preemption")
def test_decode_preempts_the_newest_when_the_pool_runs_dry(stage):
    cm = cache_manager(stage, num_pages=4)
    reqs = [req(stage, i, 4, arrival=i) for i in range(3)]
    dm = decode_manager(stage, cm, reqs)  # 3 pages used, 1 free: all three need a second page
    batch, preempted = dm.build(lambda r: (r.priority, -r.arrival))
    assert preempted == [reqs[2]] and batch.reqs == reqs[:2] and dm.running == reqs[:2]
    victim = reqs[2]
    assert victim.status is stage.core.ReqStatus.WAITING and victim.table_idx == -1
    recompute = (victim.cached_len, victim.device_len, victim.output_ids)
    assert recompute == (0, 5, [1]), "prefilled again later, its token kept"
    assert batch.out_cache_loc == cm.slots(reqs[0], 4, 5) + cm.slots(reqs[1], 4, 5)
    cm.check_integrity(dm.running)


@pytest.mark.task("4.preemption")
def test_decode_without_pressure_preempts_nobody(stage):
    cm = cache_manager(stage, num_pages=8)
    reqs = [req(stage, i, 4, arrival=i) for i in range(3)]
    dm = decode_manager(stage, cm, reqs)
    batch, preempted = dm.build(lambda r: (r.priority, -r.arrival))
    assert preempted == [] and batch.reqs == reqs and batch.phase == "decode"
    assert [len(cm.req_pages[r.rid]) for r in reqs] == [2, 2, 2]


@pytest.mark.task("4.preemption")
def test_preemption_changes_no_token(stage, memo, tiny_llama_path):
    from common.admission import without_look_ahead

    prompts = [list(range(50 * i + 3, 50 * i + 11)) for i in range(6)]
    params = stage.SamplingParams(max_new_tokens=16, ignore_eos=True)
    tight = stage.LLM(str(tiny_llama_path), attention_backend="torch", page_size=4,
                      max_total_tokens=64, verbose=False)  # 6 x 24 tokens do not fit
    without_look_ahead(tight)  # admit on the prompt alone: decoding then runs out of pages
    got = [r.token_ids for r in tight.generate(prompts, params)]
    assert tight.scheduler.total_preemptions > 0, "the pool was meant to be too small"
    roomy = memo("llm", lambda: roomy_llm(stage, tiny_llama_path))
    assert got == [r.token_ids for r in roomy.generate(prompts, params)]
    tight.scheduler.check_integrity()
