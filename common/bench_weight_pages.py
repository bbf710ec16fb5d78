"""Stage 5's weights in 2 MB pages: the matrix products of one decode step, weights in 4 KB pages against the same
weights collapsed into 2 MB pages (`engine.weights_into_huge_pages`).

    python -m common.bench weight-pages [--model smollm2-135m-instruct] [--rows 1 16 64] [--repeats 5]

Every product a decode step of the model makes (bench_gemv.step_shapes: per layer qkv, o, gate_up, down, then the
LM head), each with its own random weights of the model's shapes packed as stage 5 packs them (so nothing stays in
cache between steps), in two copies: one left as the allocator placed it, one moved into 2 MB pages. The two run
alternately, best of --repeats, float32 and bfloat16. Prints how much of each copy lies in 2 MB pages (read from
/proc/self/smaps: on a machine whose kernel declines, both read 0% and the ratio is ~1), ms per step and the ratio.
"""

from __future__ import annotations

import json
import time


def huge_fraction(tensors) -> float:
    """The share of the tensors' bytes that lie in VMAs backed by 2 MB pages, weighted by each VMA's share."""
    from stage5_cudagraph.engine import byte_span

    vmas, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                current = [lo, hi, 0]
                vmas.append(current)
            elif first == "AnonHugePages:" and current is not None:
                current[2] = int(line.split()[1]) * 1024
    total = huge = 0
    for start, end in map(byte_span, tensors):
        lo, hi, in_huge = next((v for v in vmas if v[0] <= start < v[1]), (0, 1, 0))
        total += end - start
        huge += (end - start) * min(1.0, in_huge / (hi - lo))
    return huge / total


def main(args) -> None:
    import torch

    from common.bench_gemv import step_shapes
    from common.models import resolve_model
    from common.bench_utils import header
    from stage5_cudagraph.engine import weights_into_huge_pages
    from stage5_cudagraph.layers import pack_weight
    from stage5_cudagraph.models.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((resolve_model(args.model) / "config.json").read_text()))
    shapes = step_shapes(cfg)
    header(f"weights in 4 KB vs 2 MB pages: the {len(shapes)} oneDNN products of one {args.model} decode step, "
           f"best of {args.repeats}")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        copies = {}
        for name in ("4 KB", "2 MB"):
            weights = torch.nn.ParameterList(pack_weight(torch.randn(n, k, generator=gen).to(dtype)) for n, k in shapes)
            if name == "2 MB":
                weights_into_huge_pages(weights)
            copies[name] = weights
        fractions = {name: huge_fraction(list(w)) for name, w in copies.items()}
        print(f"   {str(dtype).removeprefix('torch.')}: in 2 MB pages " +
              ", ".join(f"{name} copy {f:.0%}" for name, f in fractions.items()), flush=True)
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes}
            best = dict.fromkeys(copies, float("inf"))
            for _ in range(args.repeats):
                for name, weights in copies.items():
                    run = lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")  # noqa: E731
                                   for (_, k), w in zip(shapes, weights)]
                    run()  # warms the threads after the other copy's run
                    start = time.perf_counter()
                    run()
                    best[name] = min(best[name], time.perf_counter() - start)
            print(f"   {str(dtype).removeprefix('torch.'):9s} {rows:3d} rows: 4 KB {best['4 KB'] * 1e3:7.2f} ms/step, "
                  f"2 MB {best['2 MB'] * 1e3:7.2f} ms/step, 2 MB / 4 KB time {best['2 MB'] / best['4 KB']:.3f}",
                  flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("weight-pages", help="stage 5: a decode step's products, weights in 4 KB vs 2 MB pages")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(func=main)
