"""Stage 9's gemv against oneDNN on the products of one batch-1 decode step.

    python -m common.bench gemv [--model smollm2-135m-instruct] [--rows 1] [--repeats 6]

Every matrix product a decode step of the model makes (per layer: qkv, o, gate_up, down; then the LM head), each
with its own random weights of the model's shapes (so nothing stays in cache between steps), once through
`stage9_moe_cpu::gemv` (the weight in its blocked layout, block_for_gemv) and once through oneDNN (the weight
packed as stage 5 packs it), alternating, best of --repeats; both dtypes. Beside them, a plain read of the same matrices, one call each
(`torch.sum`, torch's own vectorized reduction: the same bytes, no product). Prints ms per step, the bandwidth that
is (weight bytes / time), the ratios, and the copy bandwidth measured first (bytes read + written; on a shared
virtual machine it moves between minutes, the in-run ratios less so).
"""

from __future__ import annotations

import json
import time


def step_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every product of one decode step, in order."""
    d = cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    layer = [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * d),
             (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def main(args) -> None:
    import torch

    from common.bench_utils import copy_bandwidth, header
    from common.models import resolve_model
    from stage9_moe.kernels import cpu
    from stage9_moe.layers import pack_weight
    from stage9_moe.models.config import ModelConfig

    if reason := cpu.unavailable_reason():
        raise SystemExit(f"gemv is not available here: {reason}")
    cfg = ModelConfig.from_hf(json.loads((resolve_model(args.model) / "config.json").read_text()))
    shapes = step_shapes(cfg)
    header(f"gemv vs oneDNN: the {len(shapes)} products of one {args.model} decode step, {args.rows} row(s), best of "
           f"{args.repeats}")
    print(f"   copy bandwidth (bytes read + written) {copy_bandwidth('cpu', gib=0.5, repeats=10) / 1e9:.1f} GB/s",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        plain = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
        packed = [pack_weight(w).data for w in plain]
        blocked = [cpu.block_for_gemv(w) for w in plain]
        xs = {k: torch.randn(args.rows, k, generator=gen).to(dtype) for _, k in shapes}
        nbytes = sum(w.numel() * w.element_size() for w in plain)
        runs = {
            "gemv": lambda: [cpu.gemv(xs[w.shape[1]], b, None, w.shape[0]) for w, b in zip(plain, blocked)],
            "oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                               for (_, k), w in zip(shapes, packed)],
            "read": lambda: [w.sum() for w in plain],
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for name, run in runs.items():
                run()  # the first pass after the other kernel's warms this one's threads
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        for name, seconds in best.items():
            print(f"   {str(dtype).removeprefix('torch.'):9s} {name:7s} {seconds * 1e3:7.2f} ms/step "
                  f"{nbytes / seconds / 1e9:6.1f} GB/s of weights")
        print(f"   {str(dtype).removeprefix('torch.'):9s} gemv / oneDNN time {best['gemv'] / best['oneDNN']:.2f}x, "
              f"gemv / read time {best['gemv'] / best['read']:.2f}x")


def add_parser(sub) -> None:
    p = sub.add_parser("gemv", help="stage 9: gemv vs oneDNN on the products of one batch-1 decode step")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=1, choices=[1, 2])
    p.add_argument("--repeats", type=int, default=6)
    p.set_defaults(func=main)
