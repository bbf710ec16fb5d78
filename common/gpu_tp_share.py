"""Stage 7's tensor parallelism at Qwen3-32B's real shape on the one GPU a machine has: tp 1, then tp N with every
rank on that GPU (`gpu_id_step=0`: gloo between the ranks, on CUDA tensors; no CUDA graphs), the same dummy
weights (load_format="dummy" builds the same model at every tp), greedy tokens and the first step's logits compared.

    python -m common.gpu_tp_share --out DIR [--model qwen3-32b] [--tp 4] [--dtype bfloat16]   # a GPU
    python -m common.gpu_tp_share --out DIR --smoke      # a CPU: tiny-llama, float32, the same code path

What it shows: the sharding at the real shape (each rank's weight bytes, ~1/N plus the replicated norms), that the
ranks' collectives give tp 1's tokens and logits (the largest absolute difference of the first step's, a prefill
of every prompt: sharded sums add in another order, so float32 differs by rounding only, bfloat16 by more), and the
device memory with all N ranks loaded. What it cannot show: NCCL,
one GPU per rank, NVLink, or any speed-up (N ranks share one GPU and talk through the host). With N GPUs the same
model runs with one GPU per rank over NCCL: `LLM(..., tp_size=N)` without gpu_id_step. Sized from the card: the
tp 1 run is skipped (and says so) when the weights would not fit; each rank's KV pool is capped
(--max-total-tokens). Writes DIR/tp_share.json after each run, and DIR/tp_share.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch

GIB = 1 << 30


def device_memory(cuda: bool) -> dict:
    if not cuda:
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"device_used_gib": (total - free) / GIB, "device_total_gib": total / GIB}


@contextlib.contextmanager
def first_step_logits(llm):
    """Within the block, the logits [B, vocab] of the engine's first forward pass (rank 0's: all-gathered, the
    whole vocabulary) are copied to the CPU, in float32, into the list this yields."""
    first: list[torch.Tensor] = []
    engine = llm.engine
    step = engine.run

    def recording(fb):
        logits = step(fb)  # [B, vocab]
        if not first:
            first.append(logits.detach().float().cpu())
        return logits

    engine.run = recording  # an instance attribute: Engine.forward and the scheduler both call self.run
    try:
        yield first
    finally:
        del engine.run


def run(path: str, tp: int, args, logits: dict) -> dict:
    from stage7_tp import LLM, SamplingParams

    cuda = args.device == "cuda"
    row: dict = {"tp": tp, "shared_device": tp > 1}
    start = time.perf_counter()
    extra = {"gpu_id_step": 0} if tp > 1 else {}
    prompts = [[(11 * i + 7 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    try:
        with LLM(path, device=args.device, dtype=args.dtype, tp_size=tp, load_format="dummy",
                 attention_backend="torch" if not cuda else None, disable_cuda_graph=True,
                 max_total_tokens=args.max_total_tokens, max_running_requests=args.num_requests,
                 verbose=False, **extra) as llm:
            row["load_s"] = time.perf_counter() - start
            reports = llm.rank_reports()
            row["weights_gib_per_rank"] = [r["weight_bytes"] / GIB for r in reports]
            row["replicated_mib"] = reports[0]["replicated_bytes"] / 2**20
            row.update(device_memory(cuda))
            t = time.perf_counter()
            with first_step_logits(llm) as first:
                out = llm.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
            logits[tp] = first[0]  # [num_requests, vocab]: one prefill of every prompt
            row["generate_s"] = time.perf_counter() - t
            row["tokens"] = [r.token_ids for r in out]
    except Exception as exc:  # noqa: BLE001 — recorded: what this machine allows is part of the result
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def markdown(report: dict) -> str:
    lines = [f"{report['model']} ({report['dtype']}, dummy weights) on {report['device']}, KV pool "
             f"{report['max_total_tokens']} tokens per rank: `python -m common.gpu_tp_share`", "",
             "| tp | ranks on one device | weights / rank GiB | device memory used GiB | load s | tokens = tp 1 | "
             "first step's logits, max abs diff from tp 1 |", "|---|---|---|---|---|---|---|"]
    base = next((r for r in report["runs"] if r["tp"] == 1 and "tokens" in r), None)
    for r in report["runs"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['tp']} | {r['shared_device']} | {r.get('error') or r['skipped']} | | | | |")
            continue
        same = "n/a (no tp 1 run)" if base is None else str(r["tokens"] == base["tokens"])
        used = f"{r['device_used_gib']:.1f}" if "device_used_gib" in r else "n/a"
        diff = r.get("logits_max_abs_diff")
        diff = "n/a" if diff is None else f"{diff:.2e} (largest logit {r['logits_max_abs']:.1f})"
        lines.append(f"| {r['tp']} | {r['shared_device']} | {max(r['weights_gib_per_rank']):.2f} | {used} | "
                     f"{r['load_s']:.1f} | {same} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from common.models import resolve_model

    parser = argparse.ArgumentParser(prog="python -m common.gpu_tp_share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-32b")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-total-tokens", type=int, default=2048, help="each rank's KV pool, in tokens")
    parser.add_argument("--num-requests", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, float32: tests the script")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.model, args.dtype = "cpu", "tiny-llama", "float32"
    elif not torch.cuda.is_available():
        parser.exit(2, "error: this check needs a CUDA GPU (--smoke runs a CPU rehearsal)\n")
    else:
        args.device = "cuda"
    path = str(resolve_model(args.model))
    cfg = json.loads((Path(path) / "config.json").read_text())
    report = {"model": args.model, "dtype": args.dtype, "max_total_tokens": args.max_total_tokens,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)", "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    logits: dict[int, torch.Tensor] = {}
    for tp in (1, args.tp):
        if args.device == "cuda" and tp == 1:  # the whole model on one GPU: only where it fits, with room to run
            need = estimate_weight_bytes(cfg) * 1.1
            if need > torch.cuda.mem_get_info()[1]:
                report["runs"].append({"tp": 1, "shared_device": False,
                                       "skipped": f"weights ~{need / GIB:.0f} GiB exceed this card"})
                continue
        report["runs"].append(run(path, tp, args, logits))
        if tp > 1 and tp in logits and 1 in logits and logits[tp].shape == logits[1].shape:
            report["runs"][-1]["logits_max_abs_diff"] = (logits[tp] - logits[1]).abs().max().item()
            report["runs"][-1]["logits_max_abs"] = logits[1].abs().max().item()
        elif tp > 1 and tp in logits and 1 in logits:  # the first steps batched the prompts differently
            report["runs"][-1]["logits_shapes"] = [list(logits[1].shape), list(logits[tp].shape)]
        (args.out / "tp_share.json").write_text(json.dumps(report, indent=1))
    (args.out / "tp_share.md").write_text(markdown(report))
    print(markdown(report))
    return report


def estimate_weight_bytes(cfg: dict) -> float:
    """bf16 bytes of a dense decoder from its config.json (embedding and LM head counted apart when untied)."""
    h, layers, inter, vocab = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"],
                               cfg["vocab_size"])
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return 2.0 * (layers * (attn + 3 * h * inter) + embed)


if __name__ == "__main__":
    main()
