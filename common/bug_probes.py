"""Symptom probes: each runs a stage package (a planted copy, or the reference) the way the user in
a bug's report did, and says whether the symptom shows: `probe(pkg) -> (seen, what it saw)`.

On the tiny random-weight models (common/models.py), so that each takes seconds on a CPU.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch


def tiny(name: str = "tiny-llama") -> Path:
    from common.models import resolve_model

    return resolve_model(name)


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def sub(pkg, name: str):
    import importlib

    return importlib.import_module(f"{pkg.__name__}.{name}")


# ------------------------------------------------------------ stage 1
def _stage1_generate(pkg, engine, n: int, **params):
    core = sub(pkg, "core")
    req = core.Req(0, list(PROMPT), core.SamplingParams(max_new_tokens=n, **params))
    return engine.generate(req)


def static_vs_growing(pkg):
    eng = sub(pkg, "engine")
    out = {kind: _stage1_generate(pkg, eng.Engine(tiny(), kv_cache=kind), 16,
                                  ignore_eos=True).output_ids for kind in ("static", "growing")}
    same = next((i for i, (a, b) in enumerate(zip(out["static"], out["growing"])) if a != b), None)
    return same is not None, (f"static {out['static'][:8]}..., growing {out['growing'][:8]}...: "
                              + ("identical" if same is None else f"first differ at token {same}"))


def first_logits_vs_transformers(pkg):
    from transformers import AutoModelForCausalLM

    engine = sub(pkg, "engine").Engine(tiny())
    kv = sub(pkg, "kv_cache").GrowingKVCache(engine.config.num_layers)
    with torch.no_grad():
        ours = engine.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), kv)
        hf = AutoModelForCausalLM.from_pretrained(str(tiny()), dtype=torch.float32)
        theirs = hf(torch.tensor([PROMPT])).logits[0, -1]
    gap = float((ours.reshape(-1) - theirs).abs().max())
    first = "differs" if int(ours.argmax()) != int(theirs.argmax()) else "agrees"
    return gap > 1e-3, f"first-token logits differ from transformers' by {gap:.2e}; argmax {first}"


def eos_ignored(pkg):
    engine = sub(pkg, "engine").Engine(tiny())
    free = _stage1_generate(pkg, engine, 12, ignore_eos=True).output_ids
    engine.eos_token_ids = {free[3]}  # a token it is known to produce: the model's "EOS" now
    req = _stage1_generate(pkg, engine, 12)
    return (len(req.output_ids) == 12 and req.finish_reason == "length",
            f"EOS {free[3]} generated at step {req.output_ids.index(free[3])}; "
            f"{len(req.output_ids)} tokens, finish_reason {req.finish_reason!r}")


# ------------------------------------------------------------ stage 2
def alone_vs_batched(pkg):
    engine = sub(pkg, "engine").Engine(tiny(), attention_backend="torch")
    core = sub(pkg, "core")
    params = core.SamplingParams(max_new_tokens=8, ignore_eos=True)
    short, longer = [7, 8, 9], list(range(20, 40))
    alone = engine.generate([core.Req(0, short, params)])[0].output_ids
    batched = engine.generate([core.Req(0, short, params), core.Req(1, longer, params)])
    got = batched[0].output_ids
    return alone != got, f"alone {alone}, batched with a 20-token prompt {got}"


def sampled_rows_turn_greedy(pkg):
    engine = sub(pkg, "engine").Engine(tiny(), attention_backend="torch")
    core = sub(pkg, "core")
    greedy = core.SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [core.Req(0, list(PROMPT), greedy)] + [
        core.Req(i, list(PROMPT), core.SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                      temperature=1.0, seed=i)) for i in (1, 2)]
    outs = [r.output_ids for r in engine.generate(reqs)]
    return (outs[1] == outs[0] and outs[2] == outs[0],
            f"greedy {outs[0]}; seed 1 {outs[1]}; seed 2 {outs[2]}")


# ------------------------------------------------------------ stage 3
def end_of_turn_list_ignored(pkg):
    free = pkg.LLM(str(tiny()), verbose=False).generate(
        [PROMPT], pkg.SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        shutil.copytree(tiny(), folder)
        gen = folder / "generation_config.json"
        config = json.loads(gen.read_text()) if gen.exists() else {}
        config["eos_token_id"] = [free[3], free[3] + 1]  # end of text, end of turn: a list
        gen.write_text(json.dumps(config))
        llm = pkg.LLM(str(folder), verbose=False)
        out = llm.generate([PROMPT], pkg.SamplingParams(max_new_tokens=12))[0]
    return (len(out.token_ids) == 12,
            f"generation_config eos_token_id [{free[3]}, ...]; {len(out.token_ids)} tokens, "
            f"finish_reason {out.finish_reason!r}")


def bf16_norm_vs_transformers(pkg):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = (torch.randn(64, 256) * 30).bfloat16()
    ours, theirs = sub(pkg, "layers").RMSNorm(256, 1e-6), LlamaRMSNorm(256, 1e-6)
    weight = torch.rand(256) + 0.5
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    with torch.no_grad():
        gap = float((ours(x).float() - theirs(x).float()).abs().max())
        exact = float((theirs(x).float() - theirs.float()(x.float())).abs().max())
    return gap > 0, (f"RMSNorm in bfloat16 differs from transformers' by {gap:.3f} "
                     f"(transformers' own bfloat16 error vs float32: {exact:.3f})")


def logits_vs_transformers_stage3(pkg):
    from transformers import AutoModelForCausalLM

    llm = pkg.LLM(str(tiny()), verbose=False)
    ours = llm.generate([PROMPT], pkg.SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny()), dtype=torch.float32)
    with torch.no_grad():
        want = int(hf(torch.tensor([PROMPT])).logits[0, -1].argmax())
    return ours.token_ids[0] != want, f"first token: ours {ours.token_ids[0]}, transformers {want}"


# ------------------------------------------------------------ stage 4 on
def _llm(pkg, **options):
    return pkg.LLM(str(tiny()), attention_backend="torch", verbose=False, **options)


def preemption_storm(pkg):
    llm = _llm(pkg, page_size=4, max_total_tokens=256)
    prompts = [list(range(10 * i + 3, 10 * i + 11)) for i in range(12)]
    llm.generate(prompts, pkg.SamplingParams(max_new_tokens=40, ignore_eos=True))
    n = llm.scheduler.total_preemptions
    return n >= 4, f"{n} preemptions for 12 requests of 8 + 40 tokens in a 256-token pool"


def abort_leaks_pages(pkg):
    llm = _llm(pkg, max_total_tokens=512)
    params = pkg.SamplingParams(max_new_tokens=30, ignore_eos=True)
    for _ in range(3):  # three clients that stop reading after a few chunks
        stream = llm.stream([PROMPT, [5, 6, 7, 8]], params)
        for i, _chunk in enumerate(stream):
            if i == 5:
                break
        stream.close()
    used = llm.scheduler.cache.num_used_pages
    return used > 0, f"{used} KV pages in use with no request running (3 streams cancelled)"


TEXT = "Hello, 世界! naïve café 🙂 done."


def stream_has_replacement_chars(pkg):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny()))
    d = sub(pkg, "detokenizer").IncrementalDetokenizer(tok)
    for t in tok.encode(TEXT, add_special_tokens=False):
        d.add(t)
    return "\ufffd" in d.text, f"streamed {d.text!r}, the text was {TEXT!r}"


def overlap_runs_past_stop(pkg):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    with _llm(pkg, max_total_tokens=256, disable_overlap=True) as llm:
        free = [r.token_ids for r in llm.generate(
            prompts, pkg.SamplingParams(max_new_tokens=8, ignore_eos=True))]
    stop = free[1][3]
    params = pkg.SamplingParams(max_new_tokens=8, stop_token_ids=[stop], ignore_eos=True)
    with _llm(pkg, max_total_tokens=256, disable_overlap=False) as llm:
        got = llm.generate(prompts, params)[1].token_ids
    after = got[got.index(stop) + 1:]
    return bool(after), (f"stop token {stop}; overlapped output {got}: "
                         f"{len(after)} token(s) after it")


def padded_graph_rows_corrupt(pkg):
    from unittest import mock

    from common import graph_emulator

    prompts = [[5, 6, 7], [9, 10], [40, 41, 42, 43]]  # 3 requests: bucket 4, one padded row
    params = pkg.SamplingParams(max_new_tokens=6, ignore_eos=True)
    options = dict(disable_overlap=True, max_total_tokens=256)
    eager = [r.token_ids for r in _llm(pkg, disable_cuda_graph=True, **options).generate(prompts,
                                                                                        params)]
    with mock.patch.object(sub(pkg, "graph"), "cuda", graph_emulator):
        graphs = [r.token_ids for r in _llm(pkg, cuda_graph_max_bs=4, **options).generate(prompts,
                                                                                          params)]
    return graphs != eager, f"graphs {graphs}, eager {eager}"


def locks_never_released(pkg):
    llm = _llm(pkg, max_total_tokens=512, page_size=2)
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21], [30, 31, 32, 33, 34]]
    llm.generate(prompts, pkg.SamplingParams(max_new_tokens=4, ignore_eos=True))
    tree = llm.scheduler.cache.tree
    return (tree.protected_size > 0, f"nothing running; radix tree protected_size "
            f"{tree.protected_size}, evictable_size {tree.evictable_size}")


def locked_prefix_evicted(pkg):
    tree = sub(pkg, "radix_cache").RadixCache()
    tree.insert([1, 2, 3], torch.tensor([10, 11, 12]))
    tree.insert([1, 2, 4], torch.tensor([10, 11, 13]))
    running = tree.match_prefix([1, 2, 3]).last_node
    tree.inc_lock_ref(running)  # a running request reads [1, 2, 3]
    freed = sorted(tree.evict(100).tolist())
    return (bool(set(freed) & {10, 11, 12}),
            f"a request runs on [1, 2, 3] (slots 10-12); evict(100) freed slots {freed}")


class RankByHand:
    """What the layers use of TPInfo, for one rank of a group whose sum the probe does by hand."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.group = rank, size, None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x  # this rank's part; the probe adds the ranks' parts up


def row_parallel_wrong_half(pkg):
    import torch.nn.functional as F

    layers = sub(pkg, "layers")
    torch.manual_seed(0)
    W, x = torch.randn(5, 8), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for rank in range(2):
        tp = RankByHand(rank, 2)
        layer = layers.RowParallelLinear(8, 5, bias=False, tp=tp)
        layer.weight.weight_loader(layer.weight, W)
        total += layer(x[:, 4 * rank : 4 * rank + 4])
    gap = float((total - F.linear(x, W)).abs().max())
    return gap > 1e-4, f"two ranks' summed output differs from the unsharded layer by {gap:.3f}"


def boundary_token_embedded_twice(pkg):
    layers = sub(pkg, "layers")
    E, ids = torch.randn(10, 4), torch.tensor([3, 4, 5, 9])
    total = torch.zeros(4, 4)
    for rank in range(2):
        tp = RankByHand(rank, 2)
        layer = layers.VocabParallelEmbedding(10, 4, tp=tp)
        layer.weight.weight_loader(layer.weight, E)
        total += layer(ids)
    wrong = [int(i) for i, row, want in zip(ids, total, E[ids]) if not torch.allclose(row, want)]
    return bool(wrong), f"vocabulary 10 over 2 ranks; ids embedded wrongly: {wrong}"


def split_stop_string_missed(pkg):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny()))
    d = sub(pkg, "detokenizer").IncrementalDetokenizer(tok, ["界!"])
    found = [d.add(t) for t in tok.encode(TEXT, add_special_tokens=False)]
    return (all(f is None for f in found),
            f"stop string '界!' (2 tokens' text) in {TEXT!r}: found {[f for f in found if f]}")


def detokenizer_keeps_aborted_state(pkg):
    from transformers import AutoTokenizer

    msgs = sub(pkg, "server.messages")
    worker = sub(pkg, "server.detokenizer_worker").DetokenizerWorker(
        AutoTokenizer.from_pretrained(str(tiny())))
    for rid in range(50):  # 50 requests, each cancelled after its first output
        worker.detokenize(msgs.ReqOutput(rid, [5, 6]))
        worker.detokenize(msgs.ReqOutput(rid, [], finished=True, finish_reason="abort"))
    n = len(worker.states)
    return n > 0, f"after 50 cancelled requests the detokenizer holds {n} decoding states"


def json_whitespace_endless(pkg):
    import json

    schema = json.dumps({"type": "object", "properties": {"age": {"type": "integer"}}})
    llm = pkg.LLM(str(tiny("tiny-qwen3")), verbose=False)
    outs = llm.generate(["Hi", "JSON please", "a b c"],
                        pkg.SamplingParams(max_new_tokens=64, temperature=0.0, json_schema=schema))
    reasons = [o.finish_reason for o in outs]
    return "length" in reasons, f"json_schema answers end with {reasons}"


def sigterm_detokenizer(pkg, wait: float) -> tuple[bool, int | None]:
    """Start the stage's detokenizer worker (forked: the stage is imported already), send it SIGTERM
    once it is in its loop, wait up to `wait` s -> (still alive, exit status). The launcher stops a
    server's children this way; each must leave by itself."""
    import multiprocessing as mp
    import os
    import signal
    import time

    ports = sub(pkg, "server.messages").PortArgs.new()
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=sub(pkg, "server.detokenizer_worker").run_detokenizer_worker,
                        args=(str(tiny()), ports, there), daemon=True)
    child.start()
    try:
        assert here.poll(60) and here.recv()[0] == "ready", "the detokenizer worker did not start"
        time.sleep(0.5)  # in its loop
        os.kill(child.pid, signal.SIGTERM)
        child.join(wait)
        return child.is_alive(), child.exitcode
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        shutil.rmtree(Path(ports.api_ipc_name.removeprefix("ipc://")).parent, ignore_errors=True)


def detokenizer_ignores_sigterm(pkg):
    alive, _ = sigterm_detokenizer(pkg, 10)
    return alive, f"10 s after SIGTERM the detokenizer worker is {'still running' if alive else 'gone'}"


def topk_mixes_tokens(pkg):
    topk = sub(pkg, "moe").TopK(2, renormalize=True, weights_in_logits_dtype=False)
    torch.manual_seed(0)
    logits = torch.randn(5, 8)
    alone, batched = topk(logits[:1]).topk_weights[0], topk(logits).topk_weights[0]
    return (not torch.allclose(alone, batched),
            f"token 0's routing weights alone {alone.tolist()}, in a batch of 5 "
            f"{batched.tolist()}")


def expert_gate_up_swapped(pkg):
    moe = sub(pkg, "moe")
    gen = torch.Generator().manual_seed(6)
    E, H, I = 2, 8, 6
    w1, w3 = torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen)
    layer = moe.FusedMoE(E, 2, H, I, tp_rank=0, tp_size=1)
    for e in range(E):
        layer.w13_weight.weight_loader(layer.w13_weight, w1[e], (e, "w1"))
        layer.w13_weight.weight_loader(layer.w13_weight, w3[e], (e, "w3"))
    gate_ok = torch.equal(layer.w13_weight[:, :I], w1)
    return not gate_ok, f"expert gate rows hold the checkpoint's gate (w1): {gate_ok}"
