"""Stages 5 and 9 on a CUDA GPU: CUDA graphs, fused kernels and overlap, measured on random-weight models of real
shapes.

    python -m common.bench_gpu_stage5 --out DIR [--stages 5 9] [--models qwen3-0.6b-shape llama3-8b-shape
        qwen3-32b-shape] [--batch-sizes 1 8 32] [--parts decode overlap workload hf]
    python -m common.bench_gpu_stage5 --out DIR --smoke   # CPU: a tiny shape, graphs from common/graph_emulator.py

Per stage, shape and batch size (part "decode"): the decode step time with CUDA graphs on (fused kernels, part
5.8), on but captured with the torch norms, RoPE and SwiGLU ("unfused"), and off; for each, the kernels per step,
the busy fraction (the time some kernel ran / wall time, from torch.profiler's kernel records) and the idle time
between steps (the gap from one step's last kernel to the next step's first, averaged). At batch 1: the step
against the memory-bandwidth floor, (weight + KV bytes read per step) / the copy bandwidth measured on this GPU.
And whether greedy tokens are equal with graphs on/off x fusion on/off (a few prompts, same weights).
Part "overlap": graphs off, batch 1, the overlap scheduler on and off alternated (on, off, on, off) on
--overlap-shape. Part "workload": nano-vllm's public benchmark (256 requests, prompt and output lengths uniform in
100..1024, seeded, ignore_eos), output tok/s. Part "hf": stage tok/s vs transformers `generate` on one batch.

Shapes: Qwen3-0.6B (28 layers, hidden 1024, 16 q / 8 kv heads of 128, q/k norm, vocab 151936, tied), Llama-3-8B
(32 layers, hidden 4096, 32 q / 8 kv heads), Qwen3-32B (64 layers, hidden 5120, 64 q / 8 kv heads, q/k norm,
intermediate 25600, untied). A shape whose bf16 weights + KV pool exceed the card's free memory is skipped, saying
so. The 32B shape is not written as a checkpoint: stage 9 builds it with load_format="dummy" (stage 5 cannot, its
rows say so), at batch 1 only, graphs on and off. Writes DIR/NAME.json after each stage and shape, DIR/NAME.md at
the end (NAME: --name, default stage5_gpu).

`--smoke` runs every part on the CPU with a tiny random model in float32 and the graph runner on the CPU emulator
(common/graph_emulator.py): its timings mean nothing, it exists so the plumbing is tested without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from common.bench_gpu_rows import (STAGES, ModelShape, build_checkpoint, decode_bytes, floor_seconds, generate,
                                   make_scheduler, memory_verdict, nano_vllm_workload, profile_steps, stage_module,
                                   timed_steps, union_length, write_json)
from common.bench_utils import copy_bandwidth, sync

PARTS = ("decode", "overlap", "workload", "hf")
__all__ = ["ModelShape", "build_checkpoint", "decode_bytes", "floor_seconds", "union_length", "main"]  # for tests


def decode_run(stage: str, engine, batch_size: int, prompt_len: int, steps: int, overlap: bool,
               profile: bool = True) -> dict:
    """Prefill batch_size requests, then time `steps` decode steps; -> step time, how many decode steps replayed
    a graph (all with graphs on, none off: the run says which path ran) and, profiled over a few more steps,
    kernels per step, busy fraction and idle time between steps."""
    dev = str(engine.device)
    core = stage_module(stage, "core")
    sched = make_scheduler(stage, engine, max_prefill_tokens=batch_size * prompt_len, record_stats=True,
                           overlap=overlap)
    for i in range(batch_size):
        sched.add_request(core.Req(i, [(7 * i + j) % 1000 + 3 for j in range(prompt_len)],
                                   core.SamplingParams(max_new_tokens=2 * steps + 8, ignore_eos=True)))
    while sched.waiting:
        sched.step()
    for _ in range(3):  # warm-up decode steps
        sched.step()
    sched.drain()
    sync(dev)
    sched.timings.clear()
    replays = engine.num_graph_replays
    wall = timed_steps(sched, steps, dev)
    row = {"step_ms": 1e3 * wall / steps, "graph_replays": engine.num_graph_replays - replays, "steps": steps,
           "cpu_ms_per_step": 1e3 * sum(t.cpu_seconds for t in sched.timings if t.phase == "decode") / steps}
    if profile:  # few steps: a profile's records are slow to read
        row.update(profile_steps(sched, min(steps, 8), dev))
    for rid in list(sched.reqs):
        sched.abort(rid)
    sched.drain()
    sched.worker.shutdown()
    return row


def tokens_equal(stage: str, engine, runners: dict, new_tokens: int) -> dict:
    """Greedy tokens of three prompts (fewer if the graphs hold fewer) with graphs on/off x fusion on/off: each
    equal to graphs on, fused?"""
    kernels = stage_module(stage, "kernels")
    vocab = engine.config.vocab_size
    count = min(3, runners["on"].max_bs) if runners["on"] is not None else 3  # a batch the graphs hold
    prompts = [[(13 * i + 5 * j) % (vocab - 3) + 3 for j in range(n)] for i, n in enumerate((8, 13, 21)[:count])]
    configs = [("graphs on, fused", runners["on"], "auto"), ("graphs on, unfused", runners.get("on_unfused"), "torch"),
               ("graphs off, fused", None, "auto"), ("graphs off, unfused", None, "torch")]
    runs = {}
    for name, runner, backend in configs:
        if runner is None and name.startswith("graphs on"):
            continue  # no unfused graphs captured (the 32B shape)
        engine.graph_runner = runner
        with kernels.use_backend(backend):  # "torch": prefill and eager decode unfused too
            runs[name] = generate(stage, engine, prompts, [new_tokens] * count)
    engine.graph_runner = runners["on"]
    want = runs["graphs on, fused"]
    differ = [name for name, toks in runs.items() if toks != want]
    return {"equal": not differ, "compared": list(runs),
            "note": "" if not differ else f"tokens differ from graphs on, fused: {', '.join(differ)}"}


def bench_stage(stage: str, shape: ModelShape, folder: Path, args, bandwidth: float) -> dict:
    """Every part for one stage on one shape (of "hf", the stage's side)."""
    Engine = stage_module(stage, "engine").Engine
    kernels = stage_module(stage, "kernels")
    GraphRunner = stage_module(stage, "graph").GraphRunner
    result: dict = {}
    extra = {"load_format": "dummy"} if shape.large else {}
    batch_sizes = [1] if shape.large else args.batch_sizes
    steps = max(8, args.steps // 2) if shape.large else args.steps
    if {"decode", "overlap", "hf"} & set(args.parts):
        # every batch of the run is a graph bucket
        max_bs = max(batch_sizes + ([] if shape.large or "hf" not in args.parts else [args.tp_batch]))
        need = max_bs * (args.prompt_len + 2 * steps + 40)
        engine = Engine(folder, device=args.device, dtype=args.dtype, verbose=False, max_running_requests=max_bs,
                        max_total_tokens=need if shape.large else max(need, args.max_total_tokens),
                        cuda_graph_max_bs=max_bs, **extra)
        runners = {"on": engine.graph_runner, "off": None}
        if not shape.large:  # the same graphs captured with the torch norms, RoPE, SwiGLU (5.8)
            with kernels.use_backend("torch"):
                runners["on_unfused"] = GraphRunner(engine, max_bs)
        if "decode" in args.parts:
            result["tokens"] = tokens_equal(stage, engine, runners, args.check_tokens)
            rows = []
            for bs in batch_sizes:
                row = {"batch": bs}
                for name, runner in runners.items():
                    engine.graph_runner = runner
                    row[f"graphs_{name}"] = decode_run(stage, engine, bs, args.prompt_len, steps, overlap=True)
                engine.graph_runner = runners["on"]
                rows.append(row)
            result["decode"] = rows
            ctx = args.prompt_len + steps // 2  # mean context during the timed steps
            w, kv = decode_bytes(shape, 1, ctx, 2)
            floor = floor_seconds(w + kv, bandwidth)
            b1 = next((r["graphs_on"]["step_ms"] / 1e3 for r in rows if r["batch"] == 1), None)
            result["floor"] = {"weight_bytes": w, "kv_bytes": kv, "context": ctx, "floor_ms": floor * 1e3,
                               "batch1_ms": None if b1 is None else b1 * 1e3,
                               "ratio": None if b1 is None else b1 / floor}
        if "hf" in args.parts and not shape.large:
            engine.graph_runner = runners["on"]
            result["tok_s"] = ours_throughput(stage, engine, args)
        if "overlap" in args.parts and shape.name == args.overlap_shape:
            engine.graph_runner = None
            result["overlap"] = [{"overlap": on, "step_ms": decode_run(stage, engine, 1, args.prompt_len, steps,
                                                                      overlap=on, profile=False)["step_ms"]}
                                 for on in [True, False] * args.overlap_repeats]
        del engine, runners
        free_device(args.device)
    if "workload" in args.parts:
        result["workload"] = workload(stage, folder, args, extra)
    return result


def workload(stage: str, folder: Path, args, extra: dict) -> dict:
    """Output tok/s on nano-vllm's workload, the engine sized for it (every request may run at once)."""
    Engine = stage_module(stage, "engine").Engine
    n = args.workload_requests
    engine = Engine(folder, device=args.device, dtype=args.dtype, verbose=False, max_running_requests=n,
                    max_total_tokens=args.workload_kv_tokens, cuda_graph_max_bs=min(n, args.workload_graph_bs),
                    **extra)
    prompts, lens = nano_vllm_workload(n, args.workload_low, args.workload_high, engine.config.vocab_size)
    generate(stage, engine, [p[:8] for p in prompts[:2]], [4, 4])  # warm-up
    sync(args.device)
    start = time.perf_counter()
    outputs = generate(stage, engine, prompts, lens)
    sync(args.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(v) for v in outputs.values())
    del engine
    free_device(args.device)
    return {"requests": n, "lengths": [args.workload_low, args.workload_high], "prompt_tokens": sum(map(len, prompts)),
            "sampled_output_tokens": sum(lens), "output_tokens": tokens, "seconds": seconds,
            "output_tok_s": tokens / seconds}


def hf_throughput(folder: Path, args) -> float:
    """transformers generate, one batch of tp_batch prompts, tp_tokens each, greedy, same weights: output tok/s."""
    from transformers import AutoModelForCausalLM

    dev = args.device
    prompts = [[(11 * i + j) % 997 + 3 for j in range(args.prompt_len)] for i in range(args.tp_batch)]
    on_gpu = {"device_map": dev} if dev.startswith("cuda") else {}  # straight onto the GPU (accelerate)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype), **on_gpu).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    kw = dict(max_new_tokens=args.tp_tokens, min_new_tokens=args.tp_tokens, do_sample=False, pad_token_id=0)
    hf.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    sync(dev)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync(dev)
    seconds = time.perf_counter() - start
    assert out.shape == (args.tp_batch, args.prompt_len + args.tp_tokens), "HF generated another number of tokens"
    del hf
    free_device(dev)
    return args.tp_batch * args.tp_tokens / seconds


def ours_throughput(stage: str, engine, args) -> float:
    """The same batch through the stage (graphs + overlap, the engine of the decode rows): output tok/s."""
    prompts = [[(11 * i + j) % 997 + 3 for j in range(args.prompt_len)] for i in range(args.tp_batch)]
    generate(stage, engine, prompts[:1], [4])  # warm-up
    sync(args.device)
    start = time.perf_counter()
    out = generate(stage, engine, prompts, [args.tp_tokens] * args.tp_batch, max_prefill_tokens=4096)
    sync(args.device)
    seconds = time.perf_counter() - start
    assert sorted(map(len, out.values())) == [args.tp_tokens] * args.tp_batch, "a request lost tokens"
    return args.tp_batch * args.tp_tokens / seconds


def free_device(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_shape(shape: ModelShape, args, bandwidth: float, report: dict) -> None:
    entry: dict = {"shape": asdict(shape), "params": shape.num_params(), "stages": {}}
    report["models"].append(entry)
    kv = args.workload_kv_tokens if args.parts == ["workload"] else args.max_total_tokens
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else None
    if (verdict := memory_verdict(shape, min(kv, 4096) if shape.large else kv, free)):
        entry["skipped"] = verdict
        return
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        t = time.perf_counter()
        build_checkpoint(shape, folder, args.device, weights=not shape.large)
        entry["build_s"] = time.perf_counter() - t
        for stage in args.stages:
            if shape.large and stage == "5":
                entry["stages"][stage] = {"skipped": "stage 5 reads checkpoints only (no load_format=dummy); a "
                                                     f"{2 * shape.num_params() / 1e9:.3g} GB one is not written"}
                continue
            try:
                entry["stages"][stage] = bench_stage(stage, shape, folder, args, bandwidth)
            except torch.cuda.OutOfMemoryError as exc:  # what this card allows is part of the result
                free_device(args.device)
                entry["stages"][stage] = {"skipped": f"out of memory: {str(exc).splitlines()[0][:200]}"}
            except Exception as exc:  # noqa: BLE001 — recorded, the other stages still run; the exit status says so
                free_device(args.device)
                entry["stages"][stage] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            write_json(args.out / f"{args.name}.json", report)  # a timeout loses only the current stage
        if "hf" in args.parts and not shape.large:
            entry["hf"] = {"batch": args.tp_batch, "tokens": args.tp_tokens, "hf_tok_s": hf_throughput(folder, args),
                           "stages_tok_s": {s: r["tok_s"] for s, r in entry["stages"].items() if "tok_s" in r}}


def fmt(x, spec: str = ".2f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def markdown(report: dict) -> str:
    lines = [f"Measured {report['date']} on {report['device']} (torch {report['torch']}), {report['dtype']}, copy "
             f"bandwidth {report['bandwidth_gb_s']:.0f} GB/s: `{report['command']}`", ""]
    dec, floor, ovl, work, hf, notes, top, runs = [], [], [], [], [], [], [], "on | off"
    for m in report["models"]:
        name = m["shape"]["name"]
        if "skipped" in m:
            notes.append(f"- {name}: {m['skipped']}")
        for stage, s in m["stages"].items():
            if "skipped" in s or "error" in s:
                notes.append(f"- stage {stage}, {name}: {s.get('skipped') or 'failed: ' + s['error']}")
            for r in s.get("decode", []):
                on, off, un = r["graphs_on"], r["graphs_off"], r.get("graphs_on_unfused")
                kps = " / ".join(fmt(x["kernels_per_step"], ".0f") for x in (on, un, off) if x)
                dec.append(f"| {stage} | {name} | {r['batch']} | {on['step_ms']:.2f} | "
                           f"{fmt(un and un['step_ms'])} | {off['step_ms']:.2f} | {kps} | "
                           f"{on['busy']:.0%} / {off['busy']:.0%} | {fmt(on['idle_ms'], '.3f')} / "
                           f"{fmt(off['idle_ms'], '.3f')} | {on['graph_replays']}/{on['steps']} / "
                           f"{off['graph_replays']}/{off['steps']} |")
                if r["batch"] == 1:
                    top += [f"| {stage} | {name} | {k} | {ms:.3f} |" for k, ms in on["top_kernels"]]
            if "floor" in s:
                f, tok = s["floor"], s["tokens"]
                floor.append(f"| {stage} | {name} | {fmt(f['batch1_ms'])} | {f['floor_ms']:.2f} | "
                             f"{fmt(f['ratio'], '.2f')}x | {tok['equal']} |")
                if tok["note"]:
                    notes.append(f"- stage {stage}, {name}: {tok['note']}")
            if "overlap" in s:
                ovl.append(f"| {stage} | {name} | " + " | ".join(f"{r['step_ms']:.2f}" for r in s["overlap"]) + " |")
                runs = " | ".join("on" if r["overlap"] else "off" for r in s["overlap"])
            if "workload" in s:
                w = s["workload"]
                work.append(f"| {stage} | {name} | {w['requests']} ({w['lengths'][0]}..{w['lengths'][1]}) | "
                            f"{w['output_tokens']} | {w['seconds']:.1f} | {w['output_tok_s']:.0f} |")
        if "hf" in m:
            h = m["hf"]
            hf += [f"| {stage} | {name} | {ours:.0f} | {h['hf_tok_s']:.0f} | {ours / h['hf_tok_s']:.1f}x "
                   f"(batch {h['batch']}) |" for stage, ours in h["stages_tok_s"].items()]
    tables = [
        (dec, "Decode step (overlap on)", "| stage | model | batch | ms, graphs on | graphs on, unfused | graphs off | "
         "kernels/step (on / unfused / off) | busy (on / off) | idle ms between steps (on / off) | "
         "steps replayed (on / off) |", 10),
        (floor, "Batch 1 against the bandwidth floor; greedy tokens equal across graphs on/off x fusion on/off",
         "| stage | model | batch-1 step ms | floor ms (weights + KV) | ratio | tokens equal |", 6),
        (ovl, "Graphs off, batch 1: overlap on and off, alternated (step ms)", f"| stage | model | {runs} |",
         2 + runs.count("|") + 1),
        (work, "nano-vllm's workload (seeded, ignore_eos): output tokens/s",
         "| stage | model | requests (lengths) | output tokens | s | output tok/s |", 6),
        (hf, "One batch vs transformers generate", "| stage | model | tok/s | HF tok/s | speed-up |", 5),
        (top, "Batch 1, graphs on: the kernels with the most GPU time (profiler)",
         "| stage | model | kernel | ms per step |", 4)]
    for rows, title, head, cols in tables:
        if rows:
            lines += [title, "", head, "|" + "---|" * cols] + rows + [""]
    found = sorted({run["idle_from"] for m in report["models"] for s in m["stages"].values()
                    for r in s.get("decode", []) for k, run in r.items() if k != "batch" and "idle_from" in run})
    if found:
        notes.append(f"- idle between steps: step boundaries from {' / '.join(found)} (common/bench_gpu_rows.py)")
    return "\n".join(lines + notes) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m common.bench_gpu_stage5", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="stage5_gpu", help="the stem of the files written")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    parser.add_argument("--models", nargs="+", choices=list(ModelShape.all()),
                        default=["qwen3-0.6b-shape", "llama3-8b-shape", "qwen3-32b-shape"])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per run (halved on 32B)")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens per prompt compared")
    parser.add_argument("--overlap-shape", default="llama3-8b-shape")
    parser.add_argument("--overlap-repeats", type=int, default=2, help="on/off pairs")
    parser.add_argument("--workload-requests", type=int, default=256)
    parser.add_argument("--workload-low", type=int, default=100)
    parser.add_argument("--workload-high", type=int, default=1024)
    parser.add_argument("--workload-kv-tokens", type=int, default=262144, help="KV pool of the workload run")
    parser.add_argument("--workload-graph-bs", type=int, default=256, help="its largest CUDA-graph batch")
    parser.add_argument("--tp-batch", type=int, default=32, help="batch of the comparison with HF")
    parser.add_argument("--tp-tokens", type=int, default=128, help="output tokens per request there")
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool size in tokens")
    parser.add_argument("--tmp", default=None, help="where the random checkpoints are written")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, emulated graphs: tests the script")
    args = parser.parse_args(argv)
    args.command = "python -m common.bench_gpu_stage5 " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        from common import graph_emulator

        large = [ModelShape.all()[m].large for m in args.models]  # a tiny shape stands in, run as they are
        args.models = (["tiny-shape"] if not all(large) else []) + (["tiny-dummy-shape"] if any(large) else [])
        args.device, args.dtype, args.batch_sizes = "cpu", "float32", [1, 3]
        args.prompt_len, args.steps, args.tp_batch, args.tp_tokens, args.max_total_tokens = 16, 4, 4, 8, 2048
        args.check_tokens, args.overlap_shape, args.overlap_repeats = 8, "tiny-shape", 2
        args.workload_requests, args.workload_low, args.workload_high = 8, 4, 16
        args.workload_kv_tokens, args.workload_graph_bs = 1024, 8
        with contextlib.ExitStack() as stack:  # the graph runners run (slowly) on the CPU
            for stage in args.stages:
                stack.enter_context(graph_emulator.emulating(stage_module(stage, "graph")))
            return run(args)
    if not torch.cuda.is_available():
        parser.exit(2, "error: this benchmark needs a CUDA GPU (--smoke runs a CPU rehearsal)\n")
    args.device, args.dtype = "cuda", "bfloat16"
    return run(args)


def run(args) -> dict:
    shapes = ModelShape.all()
    bandwidth = copy_bandwidth(args.device, gib=0.05 if args.smoke else 2.0)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run: timings mean nothing)"
    report = {"date": datetime.date.today().isoformat(), "device": device_name, "torch": torch.__version__,
              "dtype": args.dtype, "command": args.command, "bandwidth_gb_s": bandwidth / 1e9, "models": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        bench_shape(shapes[name], args, bandwidth, report)
        write_json(args.out / f"{args.name}.json", report)  # keep partial results
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    if any("error" in s for m in report["models"] for s in m["stages"].values()):
        raise SystemExit("a stage failed: see the notes under the tables")
    return report


if __name__ == "__main__":
    main()
