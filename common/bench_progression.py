"""One workload through every stage of the course, with Hugging Face's two offline engines as peers, in one run.

    python -m common.bench progression [--model M] [--num-requests 32] [--max-new-tokens 32] [--out DIR]
                                   [--peers vllm]

The same requests (SmolLM2, prompts of 32-192 tokens cut from one text, 8-32 tokens out each, greedy with EOS
ignored, so every system produces the same number of tokens) go through stage 1 (one request at a time), stage 2
and 3 (one static batch), and stages 4 on (continuous batching), each stage's engine at its defaults on this CPU,
then through stage 5 in the course's fastest CPU configuration (bfloat16, its compiled decode), then through
transformers' `generate` (one padded batch) and its continuous-batching `generate_batch` path, and with
`--peers vllm` through vLLM's CPU build in float32 and bfloat16 (its own environment: common/bench_peers.py). It
prints tokens/s per system and the tokens' agreement with stage 1 (the golden-checked baseline), and plots the
progression. The prompts share nothing, so stage 6's prefix cache has nothing to find here: `common.bench radix`
measures it.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import torch


BEST_STAGE, BEST_LABEL = "stage5_cudagraph", "stage 5, bf16 + torch.compile"
BEST_OPTIONS = {"dtype": "bfloat16", "enable_torch_compile": True}


def stage_llm(stage, name: str, path: str, num_requests: int):
    """Each stage's engine, at its defaults (attention on the torch backend: the CPU default)."""
    number = int(name.split("_")[0].removeprefix("stage"))
    if number == 1:
        return stage.LLM(path)
    if number <= 3:
        return stage.LLM(path, attention_backend="torch", max_batch_size=num_requests)
    return stage.LLM(path, attention_backend="torch", max_running_requests=num_requests, verbose=False)


def bench_progression(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.bench_utils import fitting_tokens, header, hf_cb_config, mixed_workload, run_hf, run_hf_cb, \
        run_stage, warm_up
    from common.golden import discover_stages
    from common.models import resolve_model

    path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    work = mixed_workload(tok, args.num_requests, args.max_new_tokens, seed=2, vary_output=True, min_prompt=32,
                          max_prompt=192)
    header(f"the course's progression: {args.model}, {args.num_requests} requests, prompts 32-192 tokens, "
           f"{work.output_tokens} output tokens, every stage and HF in one run")
    warm = warm_up(work)
    rows, tokens = [], {}
    for name in discover_stages():
        stage = importlib.import_module(name)
        llm = stage_llm(stage, name, path, args.num_requests)
        run_stage(name, llm, warm)
        seconds, ids = run_stage(name, llm, work)
        rows.append((name, seconds))
        tokens[name] = ids
        if hasattr(llm, "close"):
            llm.close()
        del llm
        print(f"   {name}: {work.output_tokens / seconds:.1f} tok/s", flush=True)
    # The course's fastest CPU configuration: stage 5's compiled decode, bfloat16 weights and KV cache (its tokens
    # are bfloat16's, so they may part from stage 1's float32 ones at a near tie)
    best = importlib.import_module(BEST_STAGE)
    llm = best.LLM(path, attention_backend="torch", max_running_requests=args.num_requests, verbose=False,
                   **BEST_OPTIONS)
    run_stage(BEST_STAGE, llm, warm)
    seconds, tokens["best"] = run_stage(BEST_STAGE, llm, work)
    llm.close()
    rows.append((BEST_LABEL, seconds))
    print(f"   {BEST_LABEL}: {work.output_tokens / seconds:.1f} tok/s", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = tok.pad_token_id or 0
    run_hf(hf, warm, args.num_requests, pad)
    seconds, tokens["hf"] = run_hf(hf, work, args.num_requests, pad)
    rows.append(("HF generate", seconds))
    page_size = 16
    pages = fitting_tokens(work, page_size) // page_size
    cb = hf_cb_config(pages, page_size, args.num_requests, 512)
    run_hf_cb(hf, warm, cb)
    seconds, tokens["hf_cb"] = run_hf_cb(hf, work, cb)
    hf.destroy_cached_continuous_batching_manager()
    rows.append(("HF generate_batch", seconds))
    for peer in args.peers:  # vLLM's CPU build, in its own environment and process (common/bench_peers.py)
        for dtype, label in (("float32", "vLLM-CPU, fp32"), ("bfloat16", "vLLM-CPU, bf16")):
            seconds, tokens[label] = run_vllm(path, dtype, warm, work)
            rows.append((label, seconds))
            print(f"   {label}: {work.output_tokens / seconds:.1f} tok/s", flush=True)
    base = tokens[rows[0][0]]
    peer = dict(rows)["HF generate"]
    print(f"   {'system':22s} {'seconds':>8s} {'tok/s':>7s} {'vs HF generate':>15s} {'same tokens as stage 1':>23s}")
    for (name, seconds), key in zip(rows, list(tokens)):
        same = sum(a == b for a, b in zip(tokens[key], base))
        print(f"   {name:22s} {seconds:8.2f} {work.output_tokens / seconds:7.1f} {peer / seconds:14.2f}x "
              f"{same:>15d}/{len(base)}")
    if args.out:
        plot(rows, work.output_tokens, Path(args.out))


def run_vllm(path: str, dtype: str, warm, work) -> tuple[float, list[list[int]]]:
    """vLLM-CPU on the same workload, warmed up on the same requests first; its start-up is not timed."""
    from common.bench_peers import run_peer

    request = {"model": path, "dtype": dtype, "threads": torch.get_num_threads(), "repeats": 1, "batch1": None,
               "warmup": {"prompts": warm.prompts, "max_new_tokens": warm.max_new_tokens},
               "offline": {"prompts": work.prompts, "max_new_tokens": work.max_new_tokens}}
    result = run_peer("vllm", request)["offline"]
    return min(result["seconds"]), result["token_ids"]


def plot(rows, output_tokens: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = [n.split("_")[0].replace("stage", "stage ") if n.startswith("stage") and "_" in n else n
             for n, _ in rows]
    tps = [output_tokens / s for _, s in rows]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    colors = ["C0" if n.startswith("stage") else "C7" for n in names]  # the course, then its peers
    ax.barh(names, tps, color=colors)
    ax.invert_yaxis()  # stage 1 on top, in the table's order
    for y, v in enumerate(tps):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title("one workload through every stage and its peers (SmolLM2-135M, CPU)")
    fig.tight_layout()
    path = out / "progression.png"
    fig.savefig(path, dpi=120)
    print(f"   plot: {path}")
    return path


def add_parser(sub) -> None:
    p = sub.add_parser("progression", help="one workload through stages 1-9 and HF generate / generate_batch")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write progression.png here")
    p.add_argument("--peers", nargs="*", default=[], choices=["vllm"],
                   help="also run vLLM's CPU build (float32 and bfloat16) on the same requests")
    p.set_defaults(func=bench_progression)
