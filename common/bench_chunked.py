"""Stage 4's `chunked_prefill_size` on a CPU: the offline workload at several prefill token budgets, one process.

    python -m common.bench chunked-prefill [--stage stage9_moe] [--dtypes float32 bfloat16] [--sizes 512 2048 4096]
                                           [--num-requests 64] [--max-new-tokens 128] [--repeats 3]

The workload of `common.bench offline --peers` (64 requests, prompts of 8-256 tokens, outputs of varied length,
greedy, EOS ignored), run by one engine per size, the sizes taking turns so that a drift of the machine's speed
touches them all; best of --repeats. Two timings per size: prefill only (every request generates one token: the
prompt's chunks and nothing else) and the whole workload. From stage 5 on the engines compile their small decode
batches as the peer bench runs them (`--no-compile` to skip), and from stage 6 the prefix cache is off, so that
repeats do not hit it.
"""

from __future__ import annotations

import importlib


def bench_chunked(args) -> None:
    from transformers import AutoTokenizer

    from common.bench_peers import course_options
    from common.bench_utils import Workload, header, mixed_workload, run_stage, warm_up
    from common.models import resolve_model

    path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    work = mixed_workload(tok, args.num_requests, args.max_new_tokens, seed=1, vary_output=True)
    prefill_only = Workload(work.prompts, [1] * len(work.prompts))
    stage = importlib.import_module(args.stage)
    options = course_options(args.stage, args.attention_backend, args.num_requests, not args.no_compile)
    header(f"{args.stage} chunked_prefill_size: {args.num_requests} requests, {sum(map(len, work.prompts))} prompt "
           f"tokens, {work.output_tokens} output tokens; best of {args.repeats}, sizes alternating")
    for dtype in args.dtypes:
        llms = {size: stage.LLM(path, dtype=dtype, verbose=False, chunked_prefill_size=size, **options)
                for size in args.sizes}
        try:
            for llm in llms.values():
                run_stage(args.stage, llm, warm_up(work))
                run_stage(args.stage, llm, prefill_only)  # first chunks of each size: allocation, compiled shapes
            best = {size: [float("inf"), float("inf")] for size in args.sizes}
            tokens = {}
            for _ in range(args.repeats):
                for size, llm in llms.items():
                    best[size][0] = min(best[size][0], run_stage(args.stage, llm, prefill_only)[0])
                    seconds, tokens[size] = run_stage(args.stage, llm, work)
                    best[size][1] = min(best[size][1], seconds)
        finally:
            for llm in llms.values():
                if hasattr(llm, "close"):
                    llm.close()
        base = best[args.sizes[0]][1]
        for size, (pre, full) in best.items():
            print(f"   {dtype:9s} chunked_prefill_size {size:5d}   prefill only {pre:6.2f} s   whole workload "
                  f"{full:6.2f} s  {work.output_tokens / full:7.1f} output tok/s  ({base / full:.2f}x of "
                  f"{args.sizes[0]})", flush=True)
        same = all(t == tokens[args.sizes[0]] for t in tokens.values())
        # float32 rows do not depend on the batch they share (the golden tests); bfloat16 ones may
        print(f"   {dtype:9s} the same tokens at every size: {'yes' if same else 'no'}", flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("chunked-prefill", help="stage 4 chunked_prefill_size on a CPU: the offline workload per size")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--stage", default="stage9_moe")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--sizes", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention-backend", default="cpu")
    p.add_argument("--no-compile", action="store_true", help="stages 5-9: decode eagerly")
    p.set_defaults(func=bench_chunked)
