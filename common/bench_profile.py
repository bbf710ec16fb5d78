"""Where a step's time goes, for one engine on the offline workload or on batch-1 decode.

    python -m common.bench profile [--stage stage4_scheduler] [--dtype float32] [--workload offline|batch1]
                                   [--num-requests 64] [--max-new-tokens 128] [--option KEY=VALUE ...]

Two runs of the same workload after a warm-up. The first is timed with perf_counter around the engine's parts (not
profiled, so the split is the real one): building the step's tensors and attention metadata (`prepare`), the model's
forward pass, sampling, and the rest of the step (scheduler, stop checks, detokenizer: Python on the host). The
second runs under torch.profiler and splits the forward pass's operator time by kind: matmuls, attention, KV-cache
copies (the store and any gather of K/V), other copies, elementwise work (norms, RoPE, activations, residuals); the
forward's wall time that no operator accounts for is Python and dispatch.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict

import torch

KINDS = {  # operator name fragments -> kind; the first match wins
    "matmul": ("linear", "addmm", "aten::mm", "bmm", "matmul", "mkldnn", "mkl_linear", "gemv"),
    "attention": ("scaled_dot_product", "flash_attention", "attention"),
    "KV copies": ("index_select", "index_put", "aten::index", "gather", "take"),
    "other copies": ("copy_", "cat", "clone", "contiguous", "stack", "to_copy", "empty", "zero", "fill"),
}


def kind_of(name: str) -> str:
    for kind, frags in KINDS.items():
        if any(f in name for f in frags):
            return kind
    return "elementwise"


def wrap(obj, attr: str, label: str, totals: dict):
    """Replace obj.attr by a timed (and profiler-labelled) call of itself."""
    fn = getattr(obj, attr)

    def timed(*a, **kw):
        start = time.perf_counter()
        with torch.profiler.record_function(label):
            out = fn(*a, **kw)
        totals[label] += time.perf_counter() - start
        return out

    setattr(obj, attr, timed)


def instrument(stage_name: str, llm) -> dict:
    totals: dict = defaultdict(float)
    engine = llm.engine
    wrap(engine, "prepare", "prepare", totals)
    if hasattr(engine, "run"):  # stage 5 on: the device half of a step (a compiled or replayed graph, or eager)
        wrap(engine, "run", "forward", totals)
    else:
        wrap(engine.model, "forward", "forward", totals)
    # where the scheduler calls the sampler: stage 4's output processor calls `sample`, from stage 5 on
    # run_batch.py calls `sample_tensor`
    module, name = ("run_batch", "sample_tensor") if stage_name >= "stage5" else ("output_processor", "sample")
    wrap(importlib.import_module(f"{stage_name}.scheduler.{module}"), name, "sample", totals)
    wrap(llm.scheduler, "step", "step", totals)
    return totals


def forward_op_kinds(prof) -> tuple[dict, float]:
    """Self CPU time per kind of every operator under a `forward` range, and the ranges' total wall time (µs)."""
    kinds: dict = defaultdict(float)
    forward_total = 0.0

    def walk(ev):
        for child in ev.cpu_children:
            if child.name in ("forward", "prepare", "sample", "step"):
                continue
            kinds[kind_of(child.name)] += child.self_cpu_time_total
            walk(child)

    for ev in prof.events():
        if ev.name == "forward":
            forward_total += ev.cpu_time_total
            walk(ev)
    return kinds, forward_total


def bench_profile(args) -> None:
    from transformers import AutoTokenizer

    from common.bench_utils import header, mixed_workload, run_stage, warm_up
    from common.models import resolve_model

    path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    if args.workload == "batch1":
        work = mixed_workload(tok, 1, args.max_new_tokens, seed=3, min_prompt=128, max_prompt=128)
    else:
        work = mixed_workload(tok, args.num_requests, args.max_new_tokens, seed=1, vary_output=True)
    options = dict(kv.split("=", 1) for kv in args.option)
    options = {k: int(v) if v.isdigit() else {"true": True, "false": False}.get(v.lower(), v)
               for k, v in options.items()}
    if args.stage >= "stage6":  # the timed and the profiled run repeat the prompts: not from the cache
        options.setdefault("disable_radix_cache", True)
    stage = importlib.import_module(args.stage)
    llm = stage.LLM(path, dtype=args.dtype, attention_backend=args.attention_backend,
                    max_running_requests=max(args.num_requests, 1), verbose=False, **options)
    backend = llm.engine.attn_backend.name
    header(f"profile: {args.stage} {args.dtype} {backend} backend {options or ''}, {args.workload} "
           f"({len(work.prompts)} requests, {work.output_tokens} output tokens)")
    run_stage(args.stage, llm, warm_up(work))
    totals = instrument(args.stage, llm)
    steps = {"n": 0}
    step = llm.scheduler.step

    def counted():
        steps["n"] += 1
        return step()

    llm.scheduler.step = counted
    start = time.perf_counter()
    run_stage(args.stage, llm, work)
    wall = time.perf_counter() - start
    n = steps["n"]
    parts = {"prepare (host tensors, attention metadata)": totals["prepare"], "forward": totals["forward"],
             "sample": totals["sample"],
             "scheduler, stop checks, detokenizer (Python)": totals["step"] - totals["prepare"] - totals["forward"]
             - totals["sample"], "outside steps (generate's loop)": wall - totals["step"]}
    print(f"   wall {wall:.2f} s, {n} steps, {work.output_tokens / wall:.1f} output tok/s, "
          f"{1e3 * wall / n:.2f} ms/step")
    for name, sec in parts.items():
        print(f"   {name:48s} {1e3 * sec / n:8.2f} ms/step {100 * sec / wall:5.1f}%")
    for k in totals:
        totals[k] = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_stage(args.stage, llm, work)
    kinds, fwd_us = forward_op_kinds(prof)
    ops = sum(kinds.values())
    print(f"   inside the forward pass (torch.profiler; its own overhead inflates small operators): "
          f"{fwd_us / 1e3 / n:.2f} ms/step")
    for kind in list(KINDS) + ["elementwise"]:
        print(f"   {kind:48s} {kinds[kind] / 1e3 / n:8.2f} ms/step {100 * kinds[kind] / fwd_us:5.1f}%")
    print(f"   {'Python and dispatch (forward time in no operator)':48s} {(fwd_us - ops) / 1e3 / n:8.2f} ms/step "
          f"{100 * (fwd_us - ops) / fwd_us:5.1f}%")
    if args.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if hasattr(llm, "close"):
        llm.close()


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="where a step's time goes (timed parts, then torch.profiler op kinds)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--stage", default="stage4_scheduler")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="offline", choices=["offline", "batch1"])
    p.add_argument("--attention-backend", default=None, choices=["torch", "cpu"],
                   help="default: the stage's own (stage 4: torch; stage 5 on: cpu, C++ kernels that read the paged "
                        "cache in place); torch: gather, then SDPA")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--option", nargs="*", default=[], help="engine options, e.g. cpu_graph=true")
    p.add_argument("--top", type=int, default=0, help="also print the N operators with the most self time")
    p.set_defaults(func=bench_profile)
