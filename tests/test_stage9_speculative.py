"""Speculative decoding (stage 9, part 9.11): NGRAM and STANDALONE drafts, one verify pass per step.

Greedy output must be token-identical to the engine without speculation; sampled output must follow the target's
distribution (the accept rule, tested directly on a tiny vocabulary). The engine's other features must hold with
several tokens a step: stops inside an accepted run, max_new_tokens, aborts, the radix tree, streaming, pages.
Most tests use tiny-llama drafting for itself (every draft accepted: long accepted runs) or tiny-qwen3 drafting
for it (same vocabulary, random weights: almost nothing accepted, so every step rolls back).
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch

from common.models import resolve_model
from stage9_moe import LLM, SamplingParams
from stage9_moe.server_args import ServerArgs
from stage9_moe.speculative import accept_draft, accept_sampled
from stage9_moe.speculative.ngram import propose_ngram
from stage9_moe.speculative.verify import target_probs

PROMPTS = ["The three most important inventions of the", "def fibonacci(n):", [5, 6, 7, 8] * 6]


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    with LLM(str(tiny_llama_path), page_size=4, max_total_tokens=2048, verbose=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def self_draft(tiny_llama_path):
    """The target drafts for itself: every greedy draft is accepted."""
    with LLM(str(tiny_llama_path), page_size=4, max_total_tokens=2048, verbose=False, chunked_prefill_size=8,
             speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tiny_llama_path),
             speculative_num_draft_tokens=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def ngram(tiny_llama_path):
    with LLM(str(tiny_llama_path), page_size=4, max_total_tokens=2048, verbose=False, speculative_algorithm="NGRAM",
             speculative_num_draft_tokens=5) as llm:
        yield llm


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run_steps(llm, prompt, params) -> tuple[list[list[int]], object]:
    """Step one request to the end through the engine's loop: the token ids each step gave it, and its Req."""
    rid = llm.add_request(prompt, params)
    chunks, out = [], None
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.rid == rid
            chunks.append(list(out.new_token_ids))
        llm.scheduler.check_integrity()
    return chunks, out.req


def assert_tree_holds_only_emitted_tokens(llm, prompts, results) -> None:
    """Every path from the radix tree's root is a prefix of some request's prompt + emitted tokens: no rejected
    draft (nor a token past a stop) was cached."""
    sequences = [llm.encode(p) + r.token_ids for p, r in zip(prompts, results)]
    tree = llm.scheduler.cache.tree
    for node in tree.iter_nodes():
        path, n = [], node
        while n is not tree.root_node:
            path[:0] = list(n.key)
            n = n.parent
        assert any(seq[: len(path)] == path for seq in sequences), "a token that was not emitted is cached"
    assert tree.evictable_size > 0


# ----------------------------------------------------------------------------- the pieces, alone
def test_ngram_proposes_what_followed_the_suffix_before():
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert propose_ngram(tokens, 2) == [4, 5]  # "2 3" was followed by "4 5"
    assert propose_ngram(tokens, 10) == [4, 5, 9, 9, 2, 3]  # at most what is there
    assert propose_ngram([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert propose_ngram([7, 1, 2, 8, 1, 2, 9, 3, 1, 2], 1) == [9]  # the most recent occurrence
    assert propose_ngram([5, 1, 2, 3, 6, 0, 2, 3, 7, 1, 2, 3], 1) == [6]  # the longest match wins


def test_greedy_accept_keeps_the_longest_prefix_and_the_targets_token():
    assert accept_draft([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus a bonus token
    assert accept_draft([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # stops at the first mismatch
    assert accept_draft([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accept_draft([], [3]) == [3]


def first_token_distribution(p, q, trials: int = 6000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.shape[1])
    for _ in range(trials):
        if q is None:  # a deterministic draft: always token 2
            draft = [2]
        else:
            draft = [int(torch.multinomial(q[0], 1, generator=gen))]
        token = accept_sampled(p, draft, q, gen)[0]
        counts[token] += 1
    return counts / trials


@pytest.mark.parametrize("draft_kind", ["deterministic", "sampled from q"])
def test_rejection_sampling_emits_the_targets_distribution(draft_kind):
    """Whatever the draft proposes, the first emitted token is distributed as p (total variation < 0.03 over 6000
    draws; the draft's own distribution q is far from p, so accepting drafts blindly would fail)."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.6, 0.1, 0.2, 0.1]]) if draft_kind == "sampled from q" else None
    empirical = first_token_distribution(p, q)
    total_variation = 0.5 * (empirical - p[0]).abs().sum().item()
    assert total_variation < 0.03, (empirical, p[0])
    wrong = q[0] if q is not None else torch.tensor([0.0, 0.0, 1.0, 0.0])  # "always accept"
    assert 0.5 * (wrong - p[0]).abs().sum().item() > 0.2


def test_target_probs_follow_the_samplers_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[0, 2:].sum() == 0 and torch.allclose(probs[0, :2], torch.softmax(logits[0, :2], -1))
    probs = target_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))


# ----------------------------------------------------------------------------- greedy: identical tokens
@pytest.mark.parametrize("draft", ["tiny-llama", "tiny-qwen3"])
def test_standalone_greedy_is_identical_to_decoding(plain, self_draft, tiny_llama_path, draft):
    """Drafting for itself every draft is accepted; a random draft model of the same vocabulary almost none. The
    tokens are the same either way; with a small chunked-prefill size the prompts arrive in chunks meanwhile."""
    expected = [r.token_ids for r in plain.generate(PROMPTS, greedy())]
    llm = self_draft if draft == "tiny-llama" else LLM(
        str(tiny_llama_path), page_size=4, max_total_tokens=2048, verbose=False, chunked_prefill_size=8,
        speculative_algorithm="STANDALONE", speculative_draft_model_path=str(resolve_model(draft)))
    with contextlib.nullcontext(llm) if llm is self_draft else llm:  # the fixture stays open
        llm.flush_cache()
        worker = llm.scheduler.speculative
        worker.num_drafted = worker.num_accepted = 0
        results = llm.generate(PROMPTS, greedy())
        got = [r.token_ids for r in results]
        llm.scheduler.check_integrity()
        assert_tree_holds_only_emitted_tokens(llm, PROMPTS, results)
        assert not llm.scheduler.speculative.draft.reqs  # finished requests gave their draft pages back
    assert got == expected
    assert worker.num_verify_steps > 0 and worker.num_drafted > 0
    if draft == "tiny-llama":
        assert worker.num_accepted == worker.num_drafted
    else:
        assert worker.num_accepted < worker.num_drafted / 4


@pytest.mark.parametrize("drafts", ["half right", "always wrong"])
def test_ngram_verify_rolls_back_rejected_drafts(plain, ngram, monkeypatch, drafts):
    """A random tiny model never repeats itself, so NGRAM would draft nothing here: its proposer (tested above) is
    replaced by one that drafts the true continuation with every third token wrong, or only wrong tokens. The
    output stays identical, and after every step a request holds no page past its tokens (rejected drafts' pages
    were given back in the same step)."""
    prompt = PROMPTS[0]
    params = greedy(24)
    expected = plain.generate([prompt], params)[0].token_ids
    prompt_len = len(plain.encode(prompt))

    def oracle(tokens, k):
        done = len(tokens) - prompt_len
        truth = expected[done : done + k]
        return [t + 1 if drafts == "always wrong" or i % 3 == 2 else t for i, t in enumerate(truth)]
    monkeypatch.setattr("stage9_moe.speculative.worker.propose_ngram", oracle)
    llm, worker = ngram, ngram.scheduler.speculative
    worker.num_drafted = worker.num_accepted = worker.num_verify_rows = 0
    llm.add_request(prompt, params)
    tokens = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens += out.new_token_ids
        cache = llm.scheduler.cache
        for req in llm.scheduler.decoder.running:
            assert len(cache.req_pages[req.rid]) <= cache.pages_for(req.device_len)
        llm.scheduler.check_integrity()
    assert tokens == expected
    assert worker.num_drafted > 0
    if drafts == "always wrong":  # and after each rejection the request waits longer before drafting again
        assert worker.num_accepted == 0 and worker.num_verify_rows <= 6
    else:
        assert worker.num_verify_rows < len(expected) / 2 and worker.acceptance_length > 2


def test_tp_2_accepts_the_same_tokens_on_every_rank(plain, tiny_llama_path):
    expected = [r.token_ids for r in plain.generate(PROMPTS[:2], greedy(12))]
    with LLM(str(tiny_llama_path), attention_backend="torch", tp_size=2, max_total_tokens=4096, verbose=False,
             enable_tp_sync_check=True, speculative_algorithm="STANDALONE",
             speculative_draft_model_path=str(tiny_llama_path)) as llm:
        got = [r.token_ids for r in llm.generate(PROMPTS[:2], greedy(12))]
        assert llm.scheduler.speculative.num_accepted > 0
    assert got == expected


# ----------------------------------------------------------------------------- stops inside an accepted run
def test_stops_inside_an_accepted_run_end_where_decoding_does(plain, self_draft):
    prompt = PROMPTS[0]
    chunks, _ = run_steps(self_draft, prompt, greedy(20))
    reference = plain.generate([prompt], greedy(20))[0].token_ids
    assert sum(chunks, []) == reference
    # a token first emitted in the middle of a multi-token step
    starts = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
    j = next(s + 1 for s, c in zip(starts, chunks) if len(c) >= 3 and reference.index(c[1]) == s + 1)
    for params in (greedy(20, stop_token_ids=[reference[j]]), greedy(j + 1),
                   greedy(20, stop=plain.tokenizer.decode(reference[j : j + 1]).strip() or None)):
        want = plain.generate([prompt], params)[0]
        chunks, req = run_steps(self_draft, prompt, params)
        assert sum(chunks, []) == want.token_ids and req.finish_reason == want.finish_reason
        assert req.matched_stop == want.matched_stop
    assert len(want.token_ids) <= j + 1


def test_abort_after_a_multi_token_step_frees_everything(self_draft):
    llm = self_draft
    rids = [llm.add_request(p, greedy(40)) for p in PROMPTS[:2]]
    got = {rid: [] for rid in rids}
    for _ in range(4):
        for out in llm.step():
            got[out.rid] += out.new_token_ids
        llm.scheduler.check_integrity()
    assert len(got[rids[0]]) > 4  # several tokens a step
    llm.abort_request(rids[0])
    while llm.has_unfinished_requests():
        llm.step()
        llm.scheduler.check_integrity()
    llm.flush_cache()
    llm.step()  # applies the flush
    cache = llm.scheduler.cache
    assert cache.num_free_pages == cache.pool.num_pages and not llm.scheduler.speculative.draft.reqs


def test_streaming_delivers_several_tokens_a_step_in_order(plain, self_draft):
    prompt = PROMPTS[1]
    want = plain.generate([prompt], greedy(20))[0]
    chunks = list(self_draft.stream([prompt], greedy(20)))
    assert sum((c.token_ids for c in chunks), []) == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert max(len(c.token_ids) for c in chunks) > 1 and chunks[-1].finished


def test_sampling_runs_with_drafts_and_seeds_repeat(self_draft):
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    first = self_draft.generate(PROMPTS[:2], params)
    again = self_draft.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == 10 for r in first)
    self_draft.scheduler.check_integrity()


def test_penalties_and_logprobs_decode_one_token_a_step(plain, self_draft):
    params = greedy(12, repetition_penalty=1.3)
    chunks, _ = run_steps(self_draft, PROMPTS[0], params)
    assert max(len(c) for c in chunks) == 1
    assert sum(chunks, []) == plain.generate([PROMPTS[0]], params)[0].token_ids


# ----------------------------------------------------------------------------- refused
def test_structured_outputs_are_refused_by_name(self_draft):
    with pytest.raises(ValueError, match="speculative decoding"):
        self_draft.add_request("x", SamplingParams(regex="[0-9]+"))
    assert not self_draft.has_unfinished_requests()


def test_bad_settings_are_refused(tmp_path, tiny_llama_path):
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="STANDALONE only"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_draft_model_path="tiny-llama")
    with pytest.raises(ValueError, match="unknown speculative_algorithm"):
        ServerArgs(speculative_algorithm="EAGLE7")
    with pytest.raises(ValueError, match="overlap"):
        ServerArgs(speculative_algorithm="NGRAM", disable_overlap=False)
    other = tmp_path / "other-vocab"
    other.mkdir()
    config = json.loads((tiny_llama_path / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    shutil.copy(tiny_llama_path / "tokenizer.json", other / "tokenizer.json")
    with pytest.raises(ValueError, match="vocabulary of 32000"):
        LLM(str(tiny_llama_path), verbose=False, speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(other))


def test_a_small_pool_keeps_the_tokens_identical(plain, tiny_llama_path):
    """Drafts need pages too: in a pool that holds about one request at a time (admission makes the others wait),
    draft pages are taken and given back every step; the output is still plain decoding's, the books balance."""
    prompts = [[7 + i, 8, 9, 10, 11, 12, 13, 14] for i in range(4)]
    expected = [r.token_ids for r in plain.generate(prompts, greedy(32))]
    with LLM(str(tiny_llama_path), page_size=4, max_total_tokens=48, verbose=False, schedule_conservativeness=0.0,
             speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tiny_llama_path)) as llm:
        rids = [llm.add_request(p, greedy(32)) for p in prompts]
        got = {rid: [] for rid in rids}
        while llm.has_unfinished_requests():
            for out in llm.step():
                got[out.rid] += out.new_token_ids
            llm.scheduler.check_integrity()
        assert llm.scheduler.speculative.num_accepted > 0
    assert [got[rid] for rid in rids] == expected


def test_large_cpu_batches_decode_without_drafts(plain, ngram, monkeypatch):
    """On a CPU a verify pass over more than CPU_MAX_BATCH rows costs more than its drafts save (the speculative
    bench): such a batch decodes as without speculation, with the same tokens; a smaller one proposes drafts."""
    from stage9_moe.speculative import worker

    seen, drafted = [], []  # the decode batches' sizes; the sizes of those that proposed drafts
    run, propose = worker.SpeculativeWorker.run, worker.SpeculativeWorker.propose
    monkeypatch.setattr(worker.SpeculativeWorker, "run",
                        lambda self, sch, batch: seen.append(len(batch.reqs)) or run(self, sch, batch))
    monkeypatch.setattr(worker.SpeculativeWorker, "propose",
                        lambda self, sch, reqs: drafted.append(len(reqs)) or propose(self, sch, reqs))
    prompts = [[9 + i, 8, 7, 6, 5, 4] for i in range(worker.CPU_MAX_BATCH + 1)]
    expected = [r.token_ids for r in plain.generate(prompts, greedy(8))]
    assert [r.token_ids for r in ngram.generate(prompts, greedy(8))] == expected
    assert max(seen) > worker.CPU_MAX_BATCH, "the test needs a decode batch over the limit"
    assert all(n <= worker.CPU_MAX_BATCH for n in drafted), f"batches that proposed drafts: {drafted}"
    ngram.generate(prompts[:worker.CPU_MAX_BATCH], greedy(8))
    assert worker.CPU_MAX_BATCH in drafted, "a batch within the limit proposes drafts"
