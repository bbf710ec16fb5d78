"""How much a quantized KV cache (stage 9's `kv_cache_dtype`, part 9.10) changes the greedy tokens, and
how many more tokens the same memory holds; with --quantizations, the same for quantized weights and
activations (parts 9.8 and 9.12: SmolLM2's own Q4_1 file, which dequantizes exactly to the float weights).

    python -m common.kv_quant_report [--model smollm2-135m-instruct] [--dtype float32]
                                     [--kv-cache-dtypes int8 fp8_e4m3] [--max-new-tokens 64]
                                     [--quantizations q4_1 q4_1_a8]

Against the same engine with the float cache (kv_cache_dtype auto), on the golden prompts
(tests/golden/<model>.json) and a held-out workload (prompts the golden files do not contain: 8 cut
from common.bench_utils.mixed_workload, seed 2026, 16-200 tokens), per kv_cache_dtype:

- top-1 agreement: the float run's greedy tokens are fed to both engines as a prompt (teacher
  forcing, one prefill each, through the prompt-logprobs path); the share of positions where the
  quantized engine's most likely next token equals the float engine's. One divergence cannot
  cascade: every position sees the same tokens before it.
- first divergence: each prompt generated freely (greedy) by both; the first step where the tokens
  differ ("-": none in max_new_tokens).
- the pool's bytes per token and the tokens 1 GiB of KV pool holds.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
from pathlib import Path

from common.bench_utils import mixed_workload
from common.golden import load_golden
from common.models import resolve_model

STAGE = "stage9_moe"
_rids = itertools.count(1 << 40)  # request ids of our own, far from the LLM's


def golden_prompts(model: str) -> list[tuple[str, list[int]]]:
    return [(c["name"], c["input_ids"]) for c in load_golden(model)["cases"]]


def held_out_prompts(model_path: Path, n: int = 8) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    work = mixed_workload(tokenizer, n, 1, seed=2026, min_prompt=16, max_prompt=200)
    return [(f"held_out_{i}", ids) for i, ids in enumerate(work.prompts)]


def teacher_forced_top1(llm, ids: list[int], start: int) -> list[int]:
    """The engine's most likely next token after ids[:t], for t = start .. len(ids) - 1: one prefill
    of `ids` whose prompt logprobs (from position start on) carry the top-1 token of each position."""
    stage = importlib.import_module(STAGE)
    req = importlib.import_module(f"{STAGE}.core").Req(
        next(_rids), list(ids), stage.SamplingParams(max_new_tokens=1), return_logprob=True,
        top_logprobs_num=1, logprob_start_len=start)
    llm.add_req(req)
    while not req.finished:
        llm.step()
    # entry j scores token ids[start + j] (start >= 1), from the logits after ids[:start + j]
    return [top[0][0] for _, top in req.input_token_logprobs]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def make_llm(model_path: Path, dtype: str, kv_cache_dtype: str, backend: str | None,
             quantization: str | None = None):
    stage = importlib.import_module(STAGE)
    if quantization:  # the GGUF file's blocks: SmolLM2's Q4_1 file, the float folder's source
        from common.models import _find_gguf

        model_path = _find_gguf()
    return stage.LLM(str(model_path), device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     attention_backend=backend, max_total_tokens=16384, quantization=quantization)


def measure(model: str, dtype: str, kv_dtypes: list[str], max_new_tokens: int,
            backend: str | None, quantizations: tuple[str, ...] = ()) -> list[dict]:
    stage = importlib.import_module(STAGE)
    path = resolve_model(model)
    params = stage.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    float_llm = make_llm(path, dtype, "auto", backend)
    sets = {"golden": golden_prompts(model), "held-out": held_out_prompts(path)}
    reference = {}  # workload -> [(free-running tokens, teacher-forced top-1)] of the float cache
    for name, prompts in sets.items():
        outs = float_llm.generate([ids for _, ids in prompts], params)
        reference[name] = [
            (o.token_ids, teacher_forced_top1(float_llm, ids + o.token_ids, max(len(ids), 1)))
            for (_, ids), o in zip(prompts, outs)]
    float_bytes = float_llm.engine.kv_plan.bytes_per_token
    float_llm.close()
    rows = [dict(kv="auto", workload=name, agree=1.0, diverge=["-"] * len(prompts),
                 bytes=float_bytes) for name, prompts in sets.items()]
    variants = [(kv, None) for kv in kv_dtypes] + [("auto", q) for q in quantizations]
    for kv, quantization in variants:
        llm = make_llm(path, dtype, kv, backend, quantization)
        for name, prompts in sets.items():
            outs = llm.generate([ids for _, ids in prompts], params)
            same = total = 0
            diverge = []
            for (_, ids), o, (ref_out, ref_top1) in zip(prompts, outs, reference[name]):
                top1 = teacher_forced_top1(llm, ids + ref_out, max(len(ids), 1))
                same += sum(a == b for a, b in zip(top1, ref_top1))
                total += len(ref_top1)
                step = first_divergence(o.token_ids, ref_out)
                diverge.append("-" if step is None else str(step))
            label = kv if quantization is None else f"quantization={quantization}"
            rows.append(dict(kv=label, workload=name, agree=same / total, diverge=diverge,
                             bytes=llm.engine.kv_plan.bytes_per_token))
        llm.close()
    return rows


def format_table(rows: list[dict], float_bytes: int) -> str:
    lines = [f"{'kv_cache_dtype':<25}{'workload':<10}{'top-1 agree':>12}{'bytes/token':>13}"
             f"{'tokens/GiB':>12}  first divergence per prompt"]
    for r in rows:
        lines.append(f"{r['kv']:<25}{r['workload']:<10}{r['agree']:>11.1%}{r['bytes']:>13}"
                     f"{(1 << 30) // r['bytes']:>12}  {' '.join(r['diverge'])}"
                     + (f"  ({float_bytes / r['bytes']:.2f}x tokens)" if r["bytes"] != float_bytes else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.kv_quant_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtypes", nargs="*", default=["int8", "fp8_e4m3"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--quantizations", nargs="*", default=[],
                        help="also quantized weights (SmolLM2's GGUF file), e.g. q4_1 q4_1_a8")
    args = parser.parse_args(argv)
    rows = measure(args.model, args.dtype, args.kv_cache_dtypes, args.max_new_tokens,
                   args.attention_backend, tuple(args.quantizations))
    print(f"{args.model}, {args.dtype} weights, {args.max_new_tokens} greedy tokens per prompt; "
          "against the float engine (float weights, kv_cache_dtype auto)")
    print(format_table(rows, rows[0]["bytes"]))


if __name__ == "__main__":
    main()
