"""Decode attention on a CUDA GPU: our flash-decoding Triton kernel against one program per query head.

    python -m common.bench_attention --out DIR [--shapes smollm2 llama3-8b] [--batch-sizes 1 8 64]
                                     [--contexts 512 4096 32768] [--num-kv-splits 8]
    python -m common.bench_attention --out DIR --smoke   # CPU: tiny shapes under Triton's interpreter

Times one layer's decode attention, bf16, stage 5's paged KV pool (page size 16, pages shuffled as after churn),
every request of the batch at the same context length, for three kernels in the same run:
  - flash-decoding: stage 5's TritonBackend.decode (grid batch x KV heads x num_kv_splits, each program loads its
    K/V blocks once for the whole query group, then a combine kernel over the splits);
  - per-head: the kernel it replaced, one program per (request, query head) walking every key alone, kept in this
    file as the peer;
  - torch SDPA on a contiguous [B, KVH, L, D] cache, the query group as GROUP query rows: torch's own kernels on
    the easiest layout, no page table.
Calls are timed with CUDA events around a CUDA graph of calls (stage 5 replays decode from graphs, so launch
overhead is not what is measured); each call reads the next layer of a pool of layers too big together for the L2
cache (`--l2-flush-mb`), as a model's layers do. Reported: microseconds per call, flash-decoding's speed-up over
per-head, its KV read bandwidth against a device-to-device copy's, and the largest difference between its output
and the other two.
Writes DIR/attention_gpu.json and DIR/attention_gpu.md. The defaults (num_kv_splits, BLOCK_N, num_warps) are the
backend's own and untuned: this script is how to tune them.

`--smoke` runs every step on the CPU (interpreter, eager timing with a wall clock, tiny shapes): its timings mean
nothing, it exists so the script is tested without a GPU. Any run fails (after writing its table) if the three
kernels' outputs disagree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common.bench_utils import copy_bandwidth

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see stage 2's triton_kernels.py)

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {  # name: (query heads, KV heads, head_dim)
    "smollm2": (9, 3, 64),  # SmolLM2-135M: GROUP 3
    "llama3-8b": (32, 8, 128),  # Llama-3-8B: GROUP 4
    "tiny": (4, 2, 16),  # --smoke
}
PAGE_SIZE = 16  # stage 5's default


@triton.jit
def _per_head_decode_kernel(
    Q, K_cache, V_cache, O,  # q, out: [B, H, D]; caches: [num_pages, PAGE_SIZE, KVH, D]
    req_rows, seq_lens, page_table, qk_scale,
    stride_qb, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd, stride_ob, stride_oh, stride_od, stride_ptr, stride_ptp,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # The decode kernel stages 2-5 had before flash-decoding: one program = one request x one query head, all keys.
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    pt_row = page_table + tl.load(req_rows + req).to(tl.int64) * stride_ptr
    seq_len = tl.load(seq_lens + req)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + req * stride_qb + head * stride_qh + offs_d * stride_qd, mask=mask_d, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    for n_start in range(0, seq_len, BLOCK_N):
        pos = n_start + offs_n
        mask_k = pos < seq_len
        page = tl.load(pt_row + (pos // PAGE_SIZE) * stride_ptp, mask=mask_k, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = mask_k[:, None] & mask_d[None, :]
        k = tl.load(K_cache + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V_cache + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * qk_scale
        s = tl.where(mask_k, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + req * stride_ob + head * stride_oh + offs_d * stride_od, (acc / l_i).to(O.dtype.element_ty),
             mask=mask_d)


def per_head_decode(q, k_cache, v_cache, fb, scale, interpret: bool) -> torch.Tensor:
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    out = torch.empty(q.shape, dtype=torch.float32 if interpret else q.dtype, device=q.device)
    _per_head_decode_kernel[(B, H)](
        q, k_cache, v_cache, out, fb.req_rows, fb.seq_lens, fb.page_table, scale * 1.4426950408889634,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *fb.page_table.stride(),
        PAGE_SIZE=k_cache.shape[1], GROUP=H // KVH, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_N=64 if BLOCK_D <= 128 else 32,
    )
    return out.to(q.dtype)


def build_case(H, KVH, D, batch, context, layers, dtype, device, seed=0):
    """A paged pool of `layers` layers ([L, num_pages, PAGE_SIZE, KVH, D], K and V), a shuffled page table, the same
    keys laid out contiguously for SDPA ([L, B, KVH, context, D]), and q [B, H, D]."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per_req = math.ceil(context / PAGE_SIZE)
    num_pages = batch * pages_per_req
    k = torch.randn(layers, num_pages, PAGE_SIZE, KVH, D, generator=g, device=device, dtype=dtype)
    v = torch.randn(layers, num_pages, PAGE_SIZE, KVH, D, generator=g, device=device, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g, device=device)
    page_table = perm.view(batch, pages_per_req).to(torch.int32)  # request b's pages, scattered over the pool
    order = page_table.long().flatten()

    def contiguous(pool):  # [L, B, KVH, context, D]: each request's keys in position order
        return pool[:, order].view(layers, batch, pages_per_req * PAGE_SIZE, KVH, D)[:, :, :context].transpose(2, 3) \
            .contiguous()

    fb = SimpleNamespace(req_rows=torch.arange(batch, dtype=torch.int32, device=device),
                         seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                         page_table=page_table)
    q = torch.randn(batch, H, D, generator=g, device=device, dtype=dtype)
    return SimpleNamespace(q=q, k=k, v=v, k_flat=contiguous(k), v_flat=contiguous(v), fb=fb, layers=layers)


def kernels(case, backend, scale, interpret):
    """name -> fn(layer) -> [B, H, D], the three decode attentions of the comparison."""
    q, fb = case.q, case.fb
    return {
        "flash_decoding": lambda i: backend.decode(q, case.k[i], case.v[i], fb, scale),
        "per_head": lambda i: per_head_decode(q, case.k[i], case.v[i], fb, scale, interpret),
        "sdpa": lambda i: sdpa_decode(q, case.k_flat[i], case.v_flat[i], scale),
    }


def sdpa_decode(q, k, v, scale):
    """q [B, H, D], k/v [B, KVH, L, D] -> [B, H, D]. A group's GROUP queries become GROUP query rows of one KV head
    (no mask: every one sees every key), so SDPA's flash kernel runs GQA decode without expanding K/V."""
    B, H, D = q.shape
    KVH = k.shape[1]
    return F.scaled_dot_product_attention(q.view(B, KVH, H // KVH, D), k, v, scale=scale).reshape(B, H, D)


def time_per_call(fn, layers: int, calls: int, device: str, repeats: int = 5) -> float:
    """Seconds per call. CUDA: a graph of `calls` calls (layer i % layers each), replayed `repeats` times between
    two events. CPU (--smoke): the same calls eagerly, timed with a wall clock."""
    for i in range(min(layers, calls)):  # warm-up: compiles the kernels, touches every layer
        fn(i)
    if device != "cuda":
        start = time.perf_counter()
        for i in range(calls):
            fn(i % layers)
        return (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % layers)
    graph.replay()  # once untimed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (repeats * calls)


def bench_one(name, batch, context, args, backend, interpret) -> dict:
    H, KVH, D = SHAPES[name]
    kv_bytes = batch * context * KVH * D * 2 * 2  # K and V, bf16
    row = {"shape": name, "heads": H, "kv_heads": KVH, "head_dim": D, "batch": batch, "context": context,
           "kv_bytes": kv_bytes}
    if 2 * kv_bytes > args.max_kv_gb * 2**30:  # the paged pool and SDPA's contiguous copy
        return dict(row, skipped=f"over --max-kv-gb {args.max_kv_gb}")
    # Enough layers that one pass over them does not fit in L2, and at least one call per layer in the graph.
    layers = max(1, min(1024, math.ceil(args.l2_flush_mb * 2**20 / kv_bytes)))
    calls = max(args.calls, layers)
    try:
        case = build_case(H, KVH, D, batch, context, layers, torch.bfloat16, args.device)
        fns = kernels(case, backend, D**-0.5, interpret)
        outs = {k: fn(0).float() for k, fn in fns.items()}
        row["max_diff_vs_per_head"] = (outs["flash_decoding"] - outs["per_head"]).abs().max().item()
        row["max_diff_vs_sdpa"] = (outs["flash_decoding"] - outs["sdpa"]).abs().max().item()
        row["layers"], row["calls"] = layers, calls
        for k, fn in fns.items():
            row[f"{k}_us"] = time_per_call(fn, layers, calls, args.device) * 1e6
    except torch.cuda.OutOfMemoryError:
        case = fns = None  # release what was allocated before emptying the cache
        torch.cuda.empty_cache()
        return dict(row, skipped="out of GPU memory")
    row["speedup"] = row["per_head_us"] / row["flash_decoding_us"]
    row["flash_decoding_gb_s"] = kv_bytes / (row["flash_decoding_us"] / 1e6) / 1e9
    del case, fns
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(report: dict) -> str:
    lines = [f"Measured {report['date']} on {report['device']} (torch {report['torch']}, triton {report['triton']}), "
             f"stage 5's paged kernels, bf16, page size {PAGE_SIZE}, num_kv_splits {report['num_kv_splits']}, one "
             f"layer's decode attention per call, {report['timing']}. Copy bandwidth {report['copy_gb_s']:.0f} GB/s.",
             "",
             "| shape (H/KVH/D) | batch | context | per-head µs | flash-decoding µs | speed-up | torch SDPA µs "
             "(contiguous) | flash-decoding GB/s (of copy) | max abs diff vs per-head / SDPA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        shape = f"{r['shape']} ({r['heads']}/{r['kv_heads']}/{r['head_dim']})"
        if "skipped" in r:
            lines.append(f"| {shape} | {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {shape} | {r['batch']} | {r['context']} | {r['per_head_us']:.1f} | "
                     f"{r['flash_decoding_us']:.1f} | {r['speedup']:.2f}x | {r['sdpa_us']:.1f} | "
                     f"{r['flash_decoding_gb_s']:.0f} ({r['flash_decoding_gb_s'] / report['copy_gb_s']:.0%}) | "
                     f"{r['max_diff_vs_per_head']:.1e} / {r['max_diff_vs_sdpa']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m common.bench_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama3-8b"], choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096, 32768])
    parser.add_argument("--num-kv-splits", type=int, default=None, help="default: the backend's own")
    parser.add_argument("--calls", type=int, default=32, help="decode calls per CUDA graph (at least one a layer)")
    parser.add_argument("--l2-flush-mb", type=float, default=256, help="cycle through layers totalling this much")
    parser.add_argument("--max-kv-gb", type=float, default=24, help="skip shapes whose caches need more")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes: tests the script")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.shapes, args.batch_sizes, args.contexts = "cpu", ["tiny"], [1, 3], [5, 150]
        args.calls, args.l2_flush_mb, args.num_kv_splits = 2, 0, args.num_kv_splits or 4
    elif not torch.cuda.is_available():
        parser.exit(2, "error: this benchmark needs a CUDA GPU (--smoke runs a CPU rehearsal)\n")
    else:
        args.device = "cuda"
    return run(args)


def run(args) -> dict:
    from stage5_cudagraph.attention import triton_backend

    backend = triton_backend.TritonBackend(**({} if args.num_kv_splits is None
                                              else {"num_kv_splits": args.num_kv_splits}))
    report = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run: timings mean "
                                                                                  "nothing)",
              "torch": torch.__version__, "triton": triton.__version__, "num_kv_splits": backend.num_kv_splits,
              "timing": (f"CUDA events around CUDA graphs of >= {args.calls} calls" if args.device == "cuda"
                         else "wall clock, eager, interpreter"),
              "copy_gb_s": copy_bandwidth(args.device, 1.0 if args.device == "cuda" else 0.01) / 1e9, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        for batch in args.batch_sizes:
            for context in args.contexts:
                row = bench_one(name, batch, context, args, backend, triton_backend.INTERPRET)
                report["rows"].append(row)
                print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                (args.out / "attention_gpu.json").write_text(json.dumps(report, indent=1))  # keep partial results
    table = markdown(report)
    (args.out / "attention_gpu.md").write_text(table)
    print(table)
    # bf16 inputs and outputs, fp32 math in all three: they agree to a few bf16 ulps or something is wrong.
    worst = max((max(r["max_diff_vs_per_head"], r["max_diff_vs_sdpa"]) for r in report["rows"] if "skipped" not in r),
                default=0.0)
    if worst > 2e-2:
        raise SystemExit(f"the decode kernels disagree (max abs diff {worst:.3g})")
    return report


if __name__ == "__main__":
    main()
