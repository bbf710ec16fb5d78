"""Stage 9 on a CUDA GPU, in under a minute: the fused MoE path against the reference, and the kernel tests.

    python -m common.bench_gpu_moe --out DIR            # on a machine with a CUDA GPU
    python -m common.bench_gpu_moe --out DIR --smoke    # CPU rehearsal: tiny shapes, Triton in its interpreter

1. MoE layer, bf16: Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048, expert width 768) and Mixtral-8x7B's
   (8 experts, top-2, hidden 4096, width 14336) at decode and prefill token counts; every path of
   common/bench_moe.py, the fused Triton kernels included, with each path's distance to the reference.
2. Through stage 9's LLM: a dense Qwen3 and a Qwen3-MoE of the same active parameters, the MoE with the fused path
   (CUDA graphs on) and with the reference loop (graphs off: it cannot be captured).
3. The `cuda`-marked stage 9 tests (kernels vs torch on the GPU, the model with graphs against the golden tokens).
Writes DIR/stage9_gpu.json, DIR/stage9_gpu.md (tables for the stage README) and DIR/stage9_pytest_cuda.txt.
`--smoke` runs all of it on a CPU (timings mean nothing; the cuda tests skip): it tests the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from common import bench_moe

TESTS = ["tests/test_stage9_kernels.py", "tests/test_stage9_moe.py", "tests/test_stage9_upstream_cases.py"]


def run_cuda_tests(out: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider", *TESTS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=Path(__file__).resolve().parent.parent)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text, code = f"{exc.stdout or ''}\n(timed out after {timeout} s)", 124
    (out / "stage9_pytest_cuda.txt").write_text(text)
    counts = re.compile(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s")
    summary = next((line for line in reversed(text.splitlines()) if counts.search(line)), text[-200:])
    return {"exit_code": code, "summary": summary.strip("= ")}


def markdown(report: dict) -> str:
    lines = [f"Measured {report['date']} on {report['device']} (torch {report['torch']}), {report['dtype']}.", "",
             "| MoE layer | path | ms | vs reference | max abs diff |", "|---|---|---|---|---|"]
    for layer in report["layers"]:
        for r in layer["rows"]:
            if "error" in r:
                lines.append(f"| {layer['shape']['name']} | {r['path']} | not run: {r['error']} | | |")
            else:
                lines.append(f"| {layer['shape']['name']} | {r['path']} | {r['ms']:.3f} | "
                             f"{r['speedup_vs_reference']:.2f}x | {r['max_abs_diff']:.1e} |")
    lines += ["", "| model (stage 9 LLM) | params | tokens/s | vs dense |", "|---|---|---|---|"]
    dense = report["models"][0]["tok_s"]
    for r in report["models"]:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['tok_s']:.0f} | {r['tok_s'] / dense:.2f}x |")
    lines += ["", f"cuda tests: {report['tests']['summary']} (exit {report['tests']['exit_code']})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m common.bench_gpu_moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--test-timeout", type=int, default=240)
    parser.add_argument("--tmp", default=None, help="where the random checkpoints are written")
    parser.add_argument("--smoke", action="store_true", help="CPU rehearsal with tiny shapes: tests the script")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.exit(2, "error: this benchmark needs a CUDA GPU (--smoke runs a CPU rehearsal)\n")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = bench_moe.SMOKE_LAYER_SHAPES if args.smoke else bench_moe.GPU_LAYER_SHAPES
    pair = bench_moe.ModelPair(hidden=64, layers=2, head_dim=16, experts=8, expert_width=48) if args.smoke else \
        bench_moe.ModelPair(hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, experts=32, top_k=4,
                            expert_width=256)
    if args.smoke:
        args.repeats, args.num_requests, args.max_new_tokens = 1, 2, 3
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "dtype": str(dtype)[6:],
              "device": "CPU (smoke run: timings mean nothing)" if args.smoke else torch.cuda.get_device_name()}
    args.out.mkdir(parents=True, exist_ok=True)
    report["layers"] = []
    for shape in shapes:  # on a CPU the Triton path runs in the interpreter: exercised, not timed meaningfully
        rows = bench_moe.bench_layer(shape, device, dtype, args.repeats, triton=True)
        bench_moe.print_layer_table(shape, rows)
        report["layers"].append({"shape": shape.__dict__, "rows": rows})
    runners = ["torch"] if args.smoke else ["triton", "torch"]
    report["models"] = bench_moe.bench_models(pair, device.type, str(dtype)[6:], args.num_requests,
                                              args.max_new_tokens, runners, tmp=args.tmp)
    bench_moe.print_model_table(pair, report["models"], args.num_requests, dtype.itemsize)
    (args.out / "stage9_gpu.json").write_text(json.dumps(report, indent=1))  # keep partial results
    report["tests"] = run_cuda_tests(args.out, args.test_timeout)
    (args.out / "stage9_gpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "stage9_gpu.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
