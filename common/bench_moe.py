"""Stage 9's benchmarks: the MoE layer's paths side by side, and a MoE model against a dense one of the same active
parameters. Support code for `python -m common.bench moe` and common/bench_gpu_moe.py.

Layer: one MoE layer (router output given), the same inputs and weights for every path, median of `repeats`:
  reference        stage9_moe.moe.reference_experts: a loop over the experts (transformers' eager path)
  fused, torch     the fused path's sort/pad + blocked matmuls in torch (kernels/native.py)
  grouped_mm       sort by expert + torch._grouped_mm (transformers' default path), where torch has it
  all experts      every expert on every token, weighted by the (mostly zero) routing weights: no routing at all
  fused, Triton    the fused path's Triton kernels: CUDA only (in the interpreter a CPU timing means nothing)
Each row also says how far its output is from the reference's (max |diff|).

Model: a dense Qwen3 and a Qwen3-MoE whose top-k experts add up to the dense MLP's width (same active parameters
per token), random weights, through the stage's LLM: output tokens/s on the same workload, and the MLP weight
bytes one decode step must read (every expert that some token of the batch chose: with B tokens each choosing k of
E, E * (1 - (1 - k/E)^B) experts are read on average, not k).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LayerShape:
    name: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int


CPU_LAYER_SHAPES = [  # Qwen3-30B-A3B's routing (128 experts, top-8) at a quarter of its widths; Mixtral's (8, top-2)
    LayerShape("E128 k8 H512 I192, decode 1", 1, 128, 8, 512, 192),
    LayerShape("E128 k8 H512 I192, decode 32", 32, 128, 8, 512, 192),
    LayerShape("E128 k8 H512 I192, prefill 512", 512, 128, 8, 512, 192),
    LayerShape("E8 k2 H1024 I1792, decode 1", 1, 8, 2, 1024, 1792),
    LayerShape("E8 k2 H1024 I1792, prefill 512", 512, 8, 2, 1024, 1792),
]
GPU_LAYER_SHAPES = [  # Qwen3-30B-A3B's and Mixtral-8x7B's MoE layers, at full size
    *[LayerShape(f"Qwen3-30B-A3B layer, {n} tokens", n, 128, 8, 2048, 768) for n in (1, 8, 64, 512, 4096)],
    *[LayerShape(f"Mixtral-8x7B layer, {n} tokens", n, 8, 2, 4096, 14336) for n in (1, 64, 1024)],
]
SMOKE_LAYER_SHAPES = [LayerShape("smoke E8 k2 H64 I48, 5 tokens", 5, 8, 2, 64, 48)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: Triton compilation, allocator, caches
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def all_experts(x, w13, w2, topk_weights, topk_ids):
    """Every expert on every token, then the routing weights (zero for the experts a token did not choose)."""
    dense_w = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    dense_w.scatter_(1, topk_ids, topk_weights.float())  # [M, E]
    gate, up = torch.einsum("mh,eih->emi", x, w13).chunk(2, dim=-1)  # [E, M, I] each
    out = torch.einsum("emi,ehi->emh", torch.nn.functional.silu(gate) * up, w2)  # [E, M, H]
    return torch.einsum("emh,me->mh", out.float(), dense_w).to(x.dtype)


def grouped_mm(x, w13, w2, topk_weights, topk_ids):
    """Sort the slots by expert and run torch._grouped_mm over the groups (as transformers' default path)."""
    M, k = topk_ids.shape
    flat = topk_ids.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    a = x[order // k]  # [S, H] slots grouped by expert
    gate, up = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    h = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [S, H]
    h = (h.float() * topk_weights.flatten()[order, None].float()).to(x.dtype)
    out = torch.empty_like(h)
    out[order] = h  # back to slot order
    return out.view(M, k, -1).sum(dim=1)


@functools.lru_cache(maxsize=1)
def expert_weights(experts: int, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype):
    """Random stacked experts, made on the device (Mixtral's are 2 GB in bf16); reused by same-sized shapes."""
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=gen, device=device, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=gen, device=device, dtype=dtype) / intermediate ** 0.5
    return w13, w2


def layer_inputs(shape: LayerShape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from stage9_moe.moe import TopK

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(shape.tokens, shape.experts, generator=gen, device=device, dtype=dtype)
    topk = TopK(shape.top_k, renormalize=True, weights_in_logits_dtype=True)(logits)
    return (x, *expert_weights(shape.experts, shape.hidden, shape.intermediate, device, dtype), topk.topk_weights,
            topk.topk_ids)


def bench_layer(shape: LayerShape, device: torch.device, dtype: torch.dtype, repeats: int,
                triton: bool) -> list[dict]:
    from stage9_moe.moe import fused_experts, reference_experts

    inputs = layer_inputs(shape, device, dtype)
    paths = {"reference": reference_experts,
             "fused, torch": lambda *a: fused_experts(*a, triton=False),
             "grouped_mm": grouped_mm if hasattr(torch, "_grouped_mm") else None,
             "all experts": all_experts}
    if triton:
        paths["fused, Triton"] = lambda *a: fused_experts(*a, triton=True)
    want = reference_experts(*inputs).float()
    rows = []
    for name, fn in paths.items():
        if fn is None:
            continue
        try:
            diff = (fn(*inputs).float() - want).abs().max().item()
            seconds = median_seconds(lambda: fn(*inputs), device, repeats)
        except (RuntimeError, NotImplementedError) as exc:  # e.g. grouped_mm without a kernel for this dtype here
            rows.append({"path": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"})
            continue
        rows.append({"path": name, "ms": 1e3 * seconds, "max_abs_diff": diff})
    ref = next(r["ms"] for r in rows if r["path"] == "reference")
    for r in rows:
        if "ms" in r:
            r["speedup_vs_reference"] = ref / r["ms"]
    return rows


def print_layer_table(shape: LayerShape, rows: list[dict]) -> None:
    print(f"   {shape.name}: {shape.tokens} tokens x top-{shape.top_k} of {shape.experts} experts, hidden "
          f"{shape.hidden}, expert width {shape.intermediate}")
    for r in rows:
        if "error" in r:
            print(f"      {r['path']:14s} not run: {r['error']}")
        else:
            print(f"      {r['path']:14s} {r['ms']:9.3f} ms  {r['speedup_vs_reference']:6.2f}x vs reference  "
                  f"max |diff| {r['max_abs_diff']:.1e}")


# ----------------------------------------------------------------------------- dense vs MoE, through the LLM
@dataclass
class ModelPair:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 16
    top_k: int = 2
    expert_width: int = 512  # dense MLP width = top_k * expert_width: the same active parameters

    def configs(self) -> dict[str, tuple[str, dict]]:
        common = dict(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        dense = ("Qwen3Config", dict(common, intermediate_size=self.top_k * self.expert_width))
        moe = ("Qwen3MoeConfig", dict(common, intermediate_size=self.top_k * self.expert_width,
                                      moe_intermediate_size=self.expert_width, num_experts=self.experts,
                                      num_experts_per_tok=self.top_k, norm_topk_prob=True))
        return {"dense Qwen3": dense, "Qwen3-MoE": moe}

    def mlp_bytes_per_decode_step(self, batch: int, moe: bool, dtype_bytes: int) -> float:
        """MLP weight bytes a decode step reads per layer: the dense MLP, or each expert some token chose."""
        per_expert = 3 * self.hidden * self.expert_width * dtype_bytes
        if not moe:
            return self.top_k * per_expert
        expected = self.experts * (1 - (1 - self.top_k / self.experts) ** batch)
        return expected * per_expert


def build_pair(pair: ModelPair, root: Path) -> dict[str, Path]:
    from common.models import CACHE_DIR, _build_tiny

    folders = {}
    for i, (name, (config_cls, config)) in enumerate(pair.configs().items()):
        folder = root / name.replace(" ", "-")
        folder.mkdir()
        _build_tiny(config_cls, i, config, folder, CACHE_DIR, logit_std=4.0)
        folders[name] = folder
    return folders


def bench_models(pair: ModelPair, device: str, dtype: str, num_requests: int, max_new_tokens: int,
                 runners: list[str], tmp: str | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    import stage9_moe
    from common.bench_utils import mixed_workload, run_stage, warm_up

    rows = []
    with tempfile.TemporaryDirectory(dir=tmp) as root:
        folders = build_pair(pair, Path(root))
        tok = AutoTokenizer.from_pretrained(str(folders["dense Qwen3"]))
        work = mixed_workload(tok, num_requests, max_new_tokens, seed=1, max_prompt=64)
        for name, folder in folders.items():
            for runner in (runners if name == "Qwen3-MoE" else ["-"]):
                kwargs = {} if runner == "-" else {"moe_runner_backend": runner}
                if runner == "torch" and device == "cuda":
                    kwargs["disable_cuda_graph"] = True  # the reference path cannot be captured
                llm = stage9_moe.LLM(str(folder), device=device, dtype=dtype, verbose=False,
                                     max_running_requests=num_requests, max_total_tokens=num_requests * 160,
                                     **kwargs)
                run_stage("stage9_moe", llm, warm_up(work))
                seconds, _ = run_stage("stage9_moe", llm, work)
                params = sum(p.numel() for p in llm.engine.model.parameters())
                llm.close()
                rows.append({"model": name if runner == "-" else f"{name}, moe_runner_backend={runner}",
                             "params": params, "seconds": seconds, "tok_s": work.output_tokens / seconds})
    return rows


def print_model_table(pair: ModelPair, rows: list[dict], num_requests: int, dtype_bytes: int) -> None:
    dense = rows[0]["tok_s"]
    print(f"   {'model':44s} {'params':>8s} {'tokens/s':>9s} {'vs dense':>9s}")
    for r in rows:
        print(f"   {r['model']:44s} {r['params'] / 1e6:7.1f}M {r['tok_s']:9.1f} {r['tok_s'] / dense:8.2f}x")
    for batch in (1, num_requests):
        d = pair.mlp_bytes_per_decode_step(batch, False, dtype_bytes)
        m = pair.mlp_bytes_per_decode_step(batch, True, dtype_bytes)
        print(f"   MLP weights read per layer and decode step at batch {batch}: dense {d / 2**20:.2f} MiB, "
              f"MoE {m / 2**20:.2f} MiB ({m / d:.1f}x; same active parameters per token)")


# ----------------------------------------------------------------------------- python -m common.bench moe
def add_parser(sub) -> None:
    p = sub.add_parser("moe", help="stage 9: MoE layer paths, and a MoE model vs a dense one of the same active "
                                   "parameters")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: float32 on a CPU, bfloat16 on CUDA")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--skip-models", action="store_true", help="the layer table only")
    p.set_defaults(func=main)


def main(args) -> dict:
    from common.bench_utils import header

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA GPU")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    triton = device.type == "cuda"
    shapes = GPU_LAYER_SHAPES if triton else CPU_LAYER_SHAPES
    header(f"stage 9 MoE layer, {dtype_name} on {args.device}: median of {args.repeats} calls"
           + ("" if triton else " (the Triton kernels run only in the interpreter here: not timed)"))
    report = {"layers": []}
    for shape in shapes:
        rows = bench_layer(shape, device, dtype, args.repeats, triton)
        print_layer_table(shape, rows)
        report["layers"].append({"shape": shape.__dict__, "rows": rows})
    if not args.skip_models:
        pair = ModelPair()
        runners = ["triton", "torch"] if triton else ["torch"]
        header(f"stage 9 LLM, dense vs MoE of the same active parameters ({pair.top_k} of {pair.experts} experts x "
               f"{pair.expert_width} = dense width {pair.top_k * pair.expert_width}), {args.num_requests} requests, "
               f"{args.max_new_tokens} output tokens each, {dtype_name}")
        rows = bench_models(pair, args.device, dtype_name, args.num_requests, args.max_new_tokens, runners)
        print_model_table(pair, rows, args.num_requests, dtype.itemsize)
        report["models"] = rows
    return report
