"""Stage 4's CPU attention kernels (`attention/cpu_kernels.cpp`) on their own: one layer's call, both dtypes.

    python -m common.bench cpu-attention [--stage stage5_cudagraph] [--batch 50] [--layers 30] [--repeats 7]

SmolLM2-135M's attention shape (9 query heads, 3 K/V heads, head_dim 64), page size 16, every page of the pool
shuffled (as after churn). Decode: `--batch` requests with 40-259 keys each (the offline workload's range: prompts
of 8-256 tokens and their outputs), one query each, called once per layer of a `--layers`-layer pool, so that the
KV read comes from memory as in a model's step rather than from the cache of the previous call. Prefill
(`paged_extend`): one 512-token chunk of four prompts (200, 40, 150 and 122 tokens) without cached prefixes, the
chunk the scheduler runs at a time. Best of --repeats; prints microseconds per call and, for decode, the KV bytes
per second that is. Says whether this build takes bfloat16 scores with the AVX512-BF16 dot-product instruction
(decided by the compiler flags of the machine it builds on).
"""

from __future__ import annotations

import importlib
import math
import time

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
PREFILL_PROMPTS = (200, 40, 150, 122)


def paged_case(lens: list[int], layers: int, dtype, seed: int = 0) -> dict:
    """A [layers, num_pages, PAGE_SIZE, KVH, D] K and V pool holding requests of `lens` keys on shuffled pages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / PAGE_SIZE) for n in lens]
    perm = torch.randperm(sum(pages), generator=g).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start : start + n]
        start += n
    shape = (layers, sum(pages), PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return {"k": torch.randn(shape, generator=g).to(dtype), "v": torch.randn(shape, generator=g).to(dtype),
            "page_table": table, "req_rows": torch.arange(len(lens), dtype=torch.int32),
            "seq_lens": torch.tensor(lens, dtype=torch.int32)}


def best_seconds(fn, calls: int, repeats: int) -> float:
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def uses_bf16_dot_product() -> bool:
    """Whether the kernels' build (-march=native) has AVX512-BF16, where bfloat16 scores use vdpbf16ps."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512f" in flags


def main(args) -> dict:
    import torch

    backend = importlib.import_module(f"{args.stage}.attention.cpu_backend")
    kernels = backend.load_kernels()
    scale = HEAD_DIM**-0.5
    lens = torch.randint(40, 260, (args.batch,), generator=torch.Generator().manual_seed(1)).tolist()
    kv_tokens = sum(lens)
    print(f"== {args.stage} cpu attention kernels: {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, page size "
          f"{PAGE_SIZE}, pages shuffled; decode: {args.batch} requests, {kv_tokens} keys, a {args.layers}-layer pool; "
          f"prefill: a {sum(PREFILL_PROMPTS)}-token chunk of {len(PREFILL_PROMPTS)} prompts; best of {args.repeats}")
    print(f"   bfloat16 scores by the AVX512-BF16 dot product: {'yes' if uses_bf16_dot_product() else 'no'}")
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        case = paged_case(lens, args.layers, dtype)
        q = torch.randn(args.batch, HEADS, HEAD_DIM).to(dtype)
        decode = best_seconds(lambda i: kernels.paged_decode(
            q, case["k"][i % args.layers], case["v"][i % args.layers], case["page_table"], case["req_rows"],
            case["seq_lens"], scale), args.layers, args.repeats)
        kv_bytes = kv_tokens * KV_HEADS * HEAD_DIM * 2 * case["k"].element_size()
        pre = paged_case(list(PREFILL_PROMPTS), 1, dtype, seed=2)
        cu = torch.tensor([0, *PREFILL_PROMPTS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        qp = torch.randn(sum(PREFILL_PROMPTS), HEADS, HEAD_DIM).to(dtype)
        prefill = best_seconds(lambda i: kernels.paged_extend(
            qp, pre["k"][0], pre["v"][0], pre["page_table"], pre["req_rows"], cu, pre["seq_lens"], scale),
            10, args.repeats)
        report[name] = {"decode_us": decode * 1e6, "decode_gb_s": kv_bytes / decode / 1e9, "prefill_us": prefill * 1e6}
        print(f"   {name:9s} decode {decode * 1e6:7.1f} us/call ({kv_bytes / decode / 1e9:5.1f} GB/s of K/V)   "
              f"prefill {prefill * 1e6:7.1f} us/call", flush=True)
    return report


def add_parser(sub) -> None:
    p = sub.add_parser("cpu-attention", help="stage 5: the cpu attention backend's decode and prefill kernels")
    p.add_argument("--stage", default="stage5_cudagraph")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.set_defaults(func=main)
