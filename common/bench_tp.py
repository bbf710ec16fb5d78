"""Stage 7's tensor parallelism measured: the same random-weight model at tp 1, 2 and 4, in the same run.

    python -m common.bench tp [--model qwen3-32b-2l] [--tp 1 2 4] [--dtype float32]
    python -m common.bench tp --plan          # the memory plan of the full Qwen3-32B on 1, 2, 4, 8 x 80 GB GPUs
    python -m common.bench tp --served --device cuda --model qwen3-32b --dtype bfloat16 --tp 1 4 --out DIR  # GPU

The default model is Qwen3-32B's published shape cut to 2 layers and SmolLM2's vocabulary (common/models.py):
hidden 5120, 64 query / 8 KV heads of 128, intermediate 25600, with dummy weights. For each tp it reports what one
rank holds (weights, the replicated part, KV bytes per token), what it communicated, the prefill and decode step
times, and whether the tokens equal tp 1's. On a 2-core CPU more ranks only share the same cores (and pay gloo's
copies), so expect no speed-up here: the lesson is the split and its cost, measured.
"""

from __future__ import annotations

import statistics
import time

GIB = 1 << 30


def run_tp(stage, path: str, tp: int, args):
    from stage7_tp import distributed

    params = stage.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    with stage.LLM(path, tp_size=tp, load_format="dummy", dtype=args.dtype, attention_backend="torch",
                   disable_overlap=True, record_stats=True, max_total_tokens=8192,
                   max_running_requests=args.num_requests, verbose=False) as llm:
        llm.generate([[1, 2, 3]], stage.SamplingParams(max_new_tokens=2))  # warm-up
        llm.scheduler.stats.clear()
        distributed.COMM.clear()
        start = time.perf_counter()
        tokens = [r.token_ids for r in llm.generate(prompts, params)]
        seconds = time.perf_counter() - start
        stats = llm.scheduler.stats
        comm = dict(distributed.COMM)
        reports = llm.rank_reports()
    decode = [s.seconds for s in stats if s.phase == "decode"]
    prefill = sum(s.seconds for s in stats if s.phase == "prefill")
    return {"tp": tp, "tokens": tokens, "seconds": seconds, "prefill_s": prefill,
            "decode_ms": 1e3 * statistics.median(decode), "decode_steps": len(decode), "reports": reports,
            "comm": comm}


def bench_tp(args) -> None:
    import stage7_tp
    from common.bench_utils import header
    from common.models import resolve_model

    if args.plan:
        print_plan()
        return
    if args.served:
        bench_tp_served(stage7_tp, str(resolve_model(args.model)), args)
        return
    path = str(resolve_model(args.model))
    header(f"tensor parallelism: {args.model} ({args.dtype}, dummy weights), {args.num_requests} requests of "
           f"{args.prompt_len} tokens, {args.max_new_tokens} tokens out, gloo on this CPU")
    runs = [run_tp(stage7_tp, path, tp, args) for tp in args.tp]
    base = runs[0]
    print(f"   {'tp':>3s} {'weights/rank':>13s} {'replicated':>11s} {'vs tp1':>7s} {'KV B/token/rank':>16s} "
          f"{'prefill s':>10s} {'decode ms/step':>15s} {'all-reduces':>12s} {'MiB reduced':>12s} {'same tokens':>12s}")
    w1 = base["reports"][0]["weight_bytes"]
    for run in runs:
        r0, comm = run["reports"][0], run["comm"]
        print(f"   {run['tp']:3d} {r0['weight_bytes'] / GIB:9.2f} GiB {r0['replicated_bytes'] / 2**20:7.2f} MiB "
              f"{r0['weight_bytes'] / w1:6.3f}x {r0['kv_bytes_per_token']:16d} {run['prefill_s']:10.2f} "
              f"{run['decode_ms']:15.1f} {comm.get('all_reduce calls', 0):12d} "
              f"{comm.get('all_reduce bytes', 0) / 2**20:12.1f} {str(run['tokens'] == base['tokens']):>12s}")
    for run in runs:
        sizes = sorted({r['weight_bytes'] for r in run['reports']})
        print(f"   tp {run['tp']}: every rank's weight bytes {sizes}, KV heads per rank "
              f"{sorted({r['kv_heads'] for r in run['reports']})}, collectives {run['comm']}")


def bench_tp_served(stage, path: str, args) -> None:
    """The engine as served (CUDA graphs and overlap on): per tp size, memory per rank, decode step time at batch 1
    and 32, tokens/s. Meant for a GPU with the full-depth model (--device cuda --model qwen3-32b --dtype bfloat16);
    on a CPU it rehearses the same code on a small model. A tp size the machine cannot run (NCCL wants one GPU per
    rank) is recorded with its error."""
    import json
    from pathlib import Path

    import torch

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for tp in args.tp:
        row = {"tp": tp, "model": args.model, "dtype": args.dtype,
               "device": torch.cuda.get_device_name() if cuda else "cpu"}
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with stage.LLM(path, device=args.device, tp_size=tp, load_format="dummy", dtype=args.dtype,
                           max_running_requests=64, max_total_tokens=None if cuda else 16384,
                           verbose=False) as llm:
                report = llm.rank_reports()[0]
                row.update(weights_gib=report["weight_bytes"] / GIB, kv_tokens=report["kv_tokens"])
                for batch in (1, 32):
                    prompts = [[(11 * i + j) % 40000 + 100 for j in range(128)] for i in range(batch)]
                    timings = []
                    for new in (1, 1 + args.max_new_tokens):  # prefill alone, then prefill + decode
                        params = stage.SamplingParams(max_new_tokens=new, ignore_eos=True)
                        llm.generate(prompts, params)  # warm (graph buckets, caches)
                        sync()
                        start = time.perf_counter()
                        llm.generate(prompts, params)
                        sync()
                        timings.append(time.perf_counter() - start)
                    step = (timings[1] - timings[0]) / args.max_new_tokens
                    row[f"decode_ms_bs{batch}"] = 1e3 * step
                    row[f"tok_s_bs{batch}"] = batch / step
                row["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
                row["graph_replays"] = llm.engine.num_graph_replays
        except Exception as exc:  # noqa: BLE001 — recorded: what this machine allows is the result
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        rows.append(row)
        print("  ", row, flush=True)
    lines = [f"| tp | weights / rank | peak GPU memory | KV tokens | decode ms/step bs 1 | bs 32 | tokens/s bs 32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tp']} | {r['error']} | | | | | |")
        else:
            lines.append(f"| {r['tp']} | {r['weights_gib']:.1f} GiB | {r['max_allocated_gib']:.1f} GiB | "
                         f"{r['kv_tokens']:,} | {r['decode_ms_bs1']:.2f} | {r['decode_ms_bs32']:.2f} | "
                         f"{r['tok_s_bs32']:.0f} |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stage7_gpu.json").write_text(json.dumps(rows, indent=1))
        (out / "stage7_gpu.md").write_text("\n".join(lines) + "\n")


def print_plan(hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128, inter=25600, vocab=151936,
               gpu_gib=80, mem_fraction_static=0.88) -> list[dict]:
    """Qwen3-32B in bf16 on N GPUs: what each rank holds, and how many KV tokens fit beside it (the engine's rule:
    weights + KV within mem_fraction_static of the GPU). Prints the table, returns the rows."""
    bytes_ = 2
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o + k, v
    mlp = 3 * hidden * inter
    norms = layers * (2 * hidden + 2 * head_dim) + hidden  # input/post norms, q/k norms, final norm
    split = layers * (attn + mlp) + 2 * vocab * hidden  # untied embedding and LM head
    print(f"== Qwen3-32B (bf16) tensor-parallel memory plan on {gpu_gib} GB GPUs, mem_fraction_static "
          f"{mem_fraction_static}")
    print(f"   {'GPUs':>4s} {'weights/rank GiB':>17s} {'KV heads/rank':>14s} {'KV KiB/token/rank':>18s} "
          f"{'KV tokens/rank':>15s}")
    rows = []
    for n in (1, 2, 4, 8):
        kv_local = max(1, kv_heads // n)
        replicated_kv = 0 if kv_heads >= n else 2 * kv_local * head_dim * hidden * layers
        weights = (split // n + norms + replicated_kv) * bytes_
        kv_per_token = 2 * layers * kv_local * head_dim * bytes_
        budget = gpu_gib * 1e9 * mem_fraction_static - weights  # a GPU's "80 GB": decimal GB
        tokens = int(budget // kv_per_token) if budget > 0 else 0
        fits = f"{tokens:15,d}" if tokens else f"{'does not fit':>15s}"
        print(f"   {n:4d} {weights / GIB:17.1f} {kv_local:14d} {kv_per_token / 1024:18.1f} {fits}")
        rows.append({"gpus": n, "weights_gib": weights / GIB, "kv_budget_gib": max(budget, 0) / GIB,
                     "kv_heads": kv_local, "kv_bytes_per_token": kv_per_token, "kv_tokens": tokens})
    return rows


def add_parser(sub) -> None:
    p = sub.add_parser("tp", help="stage 7 tensor parallelism: tp 1 / 2 / 4 on the Qwen3-32B shape (or --plan)")
    p.add_argument("--model", default="qwen3-32b-2l")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--plan", action="store_true", help="print the full Qwen3-32B memory plan and exit")
    p.add_argument("--served", action="store_true",
                   help="the engine as served: memory, decode step time, tokens/s (GPU: --device cuda --model "
                        "qwen3-32b --dtype bfloat16 --tp 1 4)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="with --served: write stage7_gpu.json / .md here")
    p.set_defaults(func=bench_tp)
