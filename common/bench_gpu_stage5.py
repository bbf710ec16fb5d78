"""Stage 5 on a CUDA GPU: CUDA graphs and overlap, measured on random-weight models of real shapes.

    python -m common.bench_gpu_stage5 --out DIR [--models qwen3-0.6b-shape llama3-8b-shape] [--batch-sizes 1 8 32]
    python -m common.bench_gpu_stage5 --out DIR --smoke   # CPU: a tiny shape, graphs from common/graph_emulator.py

For each shape: build a random-weight bf16 checkpoint on the GPU (transformers, saved as safetensors), load it into
stage 5, and measure
  - decode step time with CUDA graphs on and off (overlap on), per batch size, and with graphs on but captured with
    the torch norms, RoPE and SwiGLU instead of the fused Triton kernels (stage 5, part 5.8): kernels per step of
    each (the profiler's kernel records / steps);
  - device utilisation during decode: the time some kernel is running on the GPU (torch.profiler's kernel
    records, overlapping ones counted once) / wall time, over as many further steps (1.0: never idle; without
    graphs the GPU waits for each launch); plus the kernels that took most of that time;
  - batch-1 decode step against the memory-bandwidth floor: (weight bytes + KV bytes read per step) / the copy
    bandwidth measured on this GPU (a big device-to-device copy reads and writes every byte once);
  - end-to-end throughput vs transformers `generate` (same weights, same batch, greedy, fixed output length).
Writes DIR/stage5_gpu.json and DIR/stage5_gpu.md (the table for the stage README).

`--smoke` runs every step of the script on the CPU with a tiny random model, the graph runner on the CPU emulator
(common/graph_emulator.py): its timings mean nothing, it exists so the plumbing is tested without a GPU.

The Qwen3-0.6B shape is a Qwen3ForCausalLM (28 layers, hidden 1024, 16 q / 8 kv heads of 128, q/k norm, vocab
151936, tied embeddings); the Llama-3-8B shape a LlamaForCausalLM (32 layers, hidden 4096, 32 q / 8 kv heads).
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.bench_utils import copy_bandwidth, sync


@dataclass
class ModelShape:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    arch: str = "llama"  # "llama" or "qwen3"

    @classmethod
    def qwen3_0_6b(cls) -> "ModelShape":
        return cls("qwen3-0.6b-shape", 151936, 1024, 3072, 28, 16, 8, 128, True, arch="qwen3")

    @classmethod
    def llama3_8b(cls) -> "ModelShape":
        return cls("llama3-8b-shape", 128256, 4096, 14336, 32, 32, 8, 128, False)

    @classmethod
    def tiny(cls) -> "ModelShape":
        return cls("tiny-shape", 512, 64, 128, 2, 4, 2, 16, True, arch="qwen3")

    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o + k, v
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + gate, up, down + 2 norms

    def num_params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params() + embed * (1 if self.tied else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes  # K and V


def decode_bytes(shape: ModelShape, batch_size: int, context_len: int, dtype_bytes: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step must read from memory. Every matrix is read once per step whatever
    the batch; the input embedding is only a lookup of batch_size rows, so an untied table is not counted (a tied
    one is read whole by the LM head)."""
    weights = shape.num_params() - (0 if shape.tied else shape.vocab * shape.hidden)
    return weights * dtype_bytes, batch_size * context_len * shape.kv_bytes_per_token(dtype_bytes)


def floor_seconds(bytes_read: int, bandwidth_bytes_per_s: float) -> float:
    return bytes_read / bandwidth_bytes_per_s


def build_checkpoint(shape: ModelShape, folder: Path, device: str) -> None:
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[shape.arch]
    cfg = getattr(transformers, config_cls)(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tied, max_position_embeddings=4096, rope_theta=1e6,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)  # random init, on the GPU
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def decode_run(engine, batch_size: int, prompt_len: int, steps: int, overlap: bool) -> dict:
    """Prefill batch_size requests, then time `steps` decode steps; -> step time, device utilisation, and how many
    decode steps replayed a graph (all of them with graphs on, none with them off: the run says which path ran)."""
    dev = str(engine.device)
    from stage5_cudagraph.core import Req, SamplingParams
    from stage5_cudagraph.scheduler import Scheduler

    sched = Scheduler(engine, None, max_prefill_tokens=batch_size * prompt_len, record_stats=True, overlap=overlap)
    for i in range(batch_size):
        sched.add_request(Req(i, [(7 * i + j) % 1000 + 3 for j in range(prompt_len)],
                              SamplingParams(max_new_tokens=2 * steps + 8, ignore_eos=True)))
    while sched.waiting:
        sched.step()
    for _ in range(3):  # warm-up decode steps
        sched.step()
    sched.drain()
    sync(dev)
    sched.timings.clear()
    replays = engine.num_graph_replays
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sched.drain()
    sync(dev)
    wall = time.perf_counter() - start
    replays = engine.num_graph_replays - replays
    cpu = sum(t.cpu_seconds for t in sched.timings if t.phase == "decode")
    util, top, per_step = kernel_busy(sched, min(steps, 8), dev)  # few steps: a profile's records are slow to read
    for rid in list(sched.reqs):
        sched.abort(rid)
    sched.drain()
    sched.worker.shutdown()
    return {"step_ms": 1e3 * wall / steps, "device_util": util, "cpu_ms_per_step": 1e3 * cpu / steps,
            "graph_replays": replays, "steps": steps, "top_kernels": top, "kernels_per_step": per_step}


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals: overlapping ones count once."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(spans):
        if cur_end is None or a > cur_end:
            total += 0.0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    return total + (0.0 if cur_end is None else cur_end - cur_start)


def kernel_busy(sched, steps: int, dev: str) -> tuple[float, list, float]:
    """Run `steps` more decode steps under torch.profiler; -> (the fraction of their wall time in which some GPU
    kernel was running; the 5 kernels with the most time as (name, ms per step); kernels launched per step). CUDA events around a step would
    count the GPU's waits for launches as busy; the profiler's kernel records do not. The profiler adds a little CPU
    time to each launch, so without graphs the figure is a little low. On a CPU (--smoke) the records are torch's
    CPU ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            sched.step()
        sched.drain()
        sync(dev)
        wall = time.perf_counter() - start
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    kernels = [e for e in prof.events() if e.device_type == kind and e.time_range.end > e.time_range.start]
    busy_us = union_length([(e.time_range.start, e.time_range.end) for e in kernels])  # microseconds
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return busy_us / 1e6 / wall, [(name[:80], us / 1e3 / steps) for name, us in top], len(kernels) / steps


def throughput(engine, folder: Path, batch_size: int, prompt_len: int, new_tokens: int) -> dict:
    """Output tokens/s of stage 5 (graphs + overlap) vs transformers generate, same weights and workload."""
    from transformers import AutoModelForCausalLM

    from stage5_cudagraph.core import Req, SamplingParams
    from stage5_cudagraph.scheduler import Scheduler

    dev = str(engine.device)
    vocab = engine.config.vocab_size
    prompts = [[(11 * i + j) % min(1000, vocab - 3) + 3 for j in range(prompt_len)] for i in range(batch_size)]
    sched = Scheduler(engine, None, max_prefill_tokens=4096)
    sync(dev)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        sched.add_request(Req(i, p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))
    outputs = {}
    while sched.has_unfinished():
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    sync(dev)
    ours = batch_size * new_tokens / (time.perf_counter() - start)
    sched.worker.shutdown()
    assert sorted(len(v) for v in outputs.values()) == [new_tokens] * batch_size, "a request lost tokens"
    on_gpu = {"device_map": dev} if dev.startswith("cuda") else {}  # straight onto the GPU (accelerate)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **on_gpu).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    hf.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    sync(dev)
    start = time.perf_counter()
    with torch.inference_mode():
        hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync(dev)
    theirs = batch_size * new_tokens / (time.perf_counter() - start)
    assert hf_out.shape == (batch_size, prompt_len + new_tokens), "HF generated another number of tokens"
    del hf
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"batch": batch_size, "stage5_tok_s": ours, "hf_tok_s": theirs, "speedup": ours / theirs}


def bench_shape(shape: ModelShape, args, bandwidth: float) -> dict:
    from stage5_cudagraph import kernels
    from stage5_cudagraph.engine import Engine
    from stage5_cudagraph.graph import GraphRunner

    result: dict = {"shape": asdict(shape), "params": shape.num_params()}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        t = time.perf_counter()
        build_checkpoint(shape, folder, args.device)
        result["build_s"] = time.perf_counter() - t
        max_bs = max(args.batch_sizes + [args.tp_batch])  # every batch of the run is a graph bucket
        engine = Engine(folder, device=args.device, dtype="bfloat16", max_total_tokens=args.max_total_tokens,
                        max_running_requests=max_bs, cuda_graph_max_bs=max_bs)
        runner = engine.graph_runner
        with kernels.use_backend("torch"):  # the same graphs captured with the torch norms, RoPE, SwiGLU (5.8)
            unfused_runner = GraphRunner(engine, max_bs)
        rows = []
        for bs in args.batch_sizes:
            on = decode_run(engine, bs, args.prompt_len, args.steps, overlap=True)
            engine.graph_runner = unfused_runner
            unfused = decode_run(engine, bs, args.prompt_len, args.steps, overlap=True)
            engine.graph_runner = None  # same engine, same weights, eager decode
            off = decode_run(engine, bs, args.prompt_len, args.steps, overlap=True)
            no_overlap = decode_run(engine, bs, args.prompt_len, args.steps, overlap=False)
            engine.graph_runner = runner
            rows.append({"batch": bs, "graphs_on": on, "graphs_off": off,
                         "graphs_off_overlap_off": no_overlap, "graphs_on_unfused": unfused})
        result["decode"] = rows
        ctx = args.prompt_len + args.steps // 2  # mean context during the timed steps
        w, kv = decode_bytes(shape, 1, ctx, 2)
        floor = floor_seconds(w + kv, bandwidth)
        b1 = next(r for r in rows if r["batch"] == 1)["graphs_on"]["step_ms"] / 1e3 if 1 in args.batch_sizes else None
        result["floor"] = {"weight_bytes": w, "kv_bytes": kv, "context": ctx, "floor_ms": floor * 1e3,
                           "batch1_ms": None if b1 is None else b1 * 1e3,
                           "ratio": None if b1 is None else b1 / floor}
        result["throughput"] = throughput(engine, folder, args.tp_batch, args.prompt_len, args.tp_tokens)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return result


def markdown(report: dict) -> str:
    lines = [f"Measured {report['date']} on {report['device']} (torch {report['torch']}), bf16, copy bandwidth "
             f"{report['bandwidth_gb_s']:.0f} GB/s.", "",
             "| model | batch | step ms, graphs on | graphs on, unfused | graphs off | graphs on, util | "
             "graphs off, util | kernels/step (fused / unfused) | CPU ms/step | steps replayed (on / off) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    kernels = []
    for m in report["models"]:
        for r in m["decode"]:
            on, off, unfused = r["graphs_on"], r["graphs_off"], r["graphs_on_unfused"]
            lines.append(f"| {m['shape']['name']} | {r['batch']} | {on['step_ms']:.2f} | {unfused['step_ms']:.2f} | "
                         f"{off['step_ms']:.2f} | {on['device_util']:.0%} | {off['device_util']:.0%} | "
                         f"{on['kernels_per_step']:.0f} / {unfused['kernels_per_step']:.0f} | "
                         f"{on['cpu_ms_per_step']:.2f} | "
                         f"{on['graph_replays']}/{on['steps']} / {off['graph_replays']}/{off['steps']} |")
            if r["batch"] == 1 and on.get("top_kernels"):
                kernels += [f"| {m['shape']['name']} | {name} | {ms:.3f} |" for name, ms in on["top_kernels"]]
    lines += ["", "| model | batch-1 step ms | bandwidth floor ms (weights + KV) | ratio | stage 5 tok/s | HF tok/s | "
              "speed-up |", "|---|---|---|---|---|---|---|"]
    for m in report["models"]:
        f, t = m["floor"], m["throughput"]
        b1 = "n/a" if f["batch1_ms"] is None else f"{f['batch1_ms']:.2f}"
        ratio = "n/a" if f["ratio"] is None else f"{f['ratio']:.2f}x"
        lines.append(f"| {m['shape']['name']} | {b1} | {f['floor_ms']:.2f} | {ratio} | {t['stage5_tok_s']:.0f} | "
                     f"{t['hf_tok_s']:.0f} | {t['speedup']:.1f}x (batch {t['batch']}) |")
    if kernels:
        lines += ["", "Batch 1, graphs on: the kernels with the most GPU time (profiler)", "",
                  "| model | kernel | ms per step |", "|---|---|---|"] + kernels
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m common.bench_gpu_stage5", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "llama3-8b-shape"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--tp-batch", type=int, default=32, help="batch of the throughput comparison")
    parser.add_argument("--tp-tokens", type=int, default=128, help="output tokens per request there")
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool size in tokens")
    parser.add_argument("--tmp", default=None, help="where the random checkpoints are written")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, emulated graphs: tests the script")
    args = parser.parse_args(argv)
    if args.smoke:
        import stage5_cudagraph.graph

        from common import graph_emulator

        args.device, args.models, args.batch_sizes = "cpu", ["tiny-shape"], [1, 3]
        args.prompt_len, args.steps, args.tp_batch, args.tp_tokens, args.max_total_tokens = 16, 4, 4, 8, 2048
        with graph_emulator.emulating(stage5_cudagraph.graph):  # the graph runner runs (slowly) on the CPU
            return run(args)
    if not torch.cuda.is_available():
        parser.exit(2, "error: this benchmark needs a CUDA GPU (--smoke runs a CPU rehearsal)\n")
    args.device = "cuda"
    return run(args)


def run(args) -> dict:
    shapes = {s.name: s for s in (ModelShape.qwen3_0_6b(), ModelShape.llama3_8b(), ModelShape.tiny())}
    bandwidth = copy_bandwidth(args.device, gib=0.05 if args.smoke else 2.0)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run: timings mean nothing)"
    report = {"date": datetime.date.today().isoformat(), "device": device_name,
              "torch": torch.__version__, "bandwidth_gb_s": bandwidth / 1e9, "models": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        report["models"].append(bench_shape(shapes[name], args, bandwidth))
        (args.out / "stage5_gpu.json").write_text(json.dumps(report, indent=1))  # keep partial results
    (args.out / "stage5_gpu.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
