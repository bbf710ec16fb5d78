"""The pieces of common/bench_gpu_stage5.py that are not the run itself: model shapes and their byte counts, the
random checkpoint, the memory check, the profiler's reading of a run (busy fraction, idle time between steps),
greedy generation through a stage's scheduler, and nano-vllm's public throughput workload."""

from __future__ import annotations

import contextlib
import importlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.bench_utils import sync

GIB = 1 << 30
STEP_MARK = "bench::decode_step"  # the profiler range around each step's device work
STAGES = {"5": "stage5_cudagraph", "9": "stage9_moe"}


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
    dummy: bool = False  # run as the large shapes are (the CPU rehearsal of their path)

    @classmethod
    def qwen3_0_6b(cls) -> "ModelShape":
        return cls("qwen3-0.6b-shape", 151936, 1024, 3072, 28, 16, 8, 128, True, arch="qwen3")

    @classmethod
    def llama3_8b(cls) -> "ModelShape":
        return cls("llama3-8b-shape", 128256, 4096, 14336, 32, 32, 8, 128, False)

    @classmethod
    def qwen3_32b(cls) -> "ModelShape":
        return cls("qwen3-32b-shape", 151936, 5120, 25600, 64, 64, 8, 128, False, arch="qwen3")

    @classmethod
    def tiny(cls) -> "ModelShape":
        return cls("tiny-shape", 512, 64, 128, 2, 4, 2, 16, True, arch="qwen3")

    @classmethod
    def all(cls) -> dict[str, "ModelShape"]:
        tiny_dummy = cls("tiny-dummy-shape", 512, 64, 128, 2, 4, 2, 16, False, arch="qwen3", dummy=True)
        return {s.name: s for s in (cls.qwen3_0_6b(), cls.llama3_8b(), cls.qwen3_32b(), cls.tiny(), tiny_dummy)}

    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o + k, v
        qk_norm = 2 * self.head_dim if self.arch == "qwen3" else 0
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden + qk_norm  # + MLP + 2 norms

    def num_params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params() + embed * (1 if self.tied else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes  # K and V

    @property
    def large(self) -> bool:
        """Too big to write as a checkpoint in the time a GPU check has (tens of GB): dummy weights, batch 1."""
        return self.dummy or self.num_params() > 20e9


def decode_bytes(shape: ModelShape, batch_size: int, context_len: int, dtype_bytes: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step must read from memory. Every matrix is read once per step whatever
    the batch; the input embedding is only a lookup of batch_size rows, so an untied table is not counted (a tied
    one is read whole by the LM head)."""
    weights = shape.num_params() - (0 if shape.tied else shape.vocab * shape.hidden)
    return weights * dtype_bytes, batch_size * context_len * shape.kv_bytes_per_token(dtype_bytes)


def floor_seconds(bytes_read: int, bandwidth_bytes_per_s: float) -> float:
    return bytes_read / bandwidth_bytes_per_s


def memory_verdict(shape: ModelShape, kv_tokens: int, free_bytes: int | None) -> str | None:
    """None if bf16 weights + a KV pool of kv_tokens (+10% and 2 GiB for activations, logits and graphs) fit in
    free_bytes (None: a CPU, not checked); else the sentence the report prints instead of the shape's rows."""
    if free_bytes is None:
        return None
    need = (2 * shape.num_params() + kv_tokens * shape.kv_bytes_per_token(2)) * 1.1 + 2 * GIB
    if need <= free_bytes:
        return None
    return f"skipped: needs ~{need / GIB:.0f} GiB (bf16 weights + KV), {free_bytes / GIB:.0f} GiB free on this card"


def build_checkpoint(shape: ModelShape, folder: Path, device: str, weights: bool = True) -> None:
    """A random-weight bf16 checkpoint of the shape (transformers' init, seed 0), or only its config.json
    (weights=False: for an engine's load_format="dummy")."""
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[shape.arch]
    cfg = getattr(transformers, config_cls)(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tied, max_position_embeddings=4096, rope_theta=1e6,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", architectures=[model_cls])
    if not weights:
        folder.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(folder)
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)  # random init, on the GPU
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def stage_module(stage: str, name: str):
    return importlib.import_module(f"{STAGES[stage]}.{name}")


def make_scheduler(stage: str, engine, **kw):
    """A stage's scheduler on the engine, without stage 6+'s radix cache: each run starts from an empty cache
    (the tree of a finished run would keep its pages)."""
    Scheduler = stage_module(stage, "scheduler").Scheduler
    if stage != "5":
        kw["disable_radix_cache"] = True
    return Scheduler(engine, None, **kw)


def generate(stage: str, engine, prompts: list[list[int]], new_tokens: list[int], **sched_kw) -> dict[int, list]:
    """Greedy tokens of every prompt (ignore_eos, new_tokens[i] each) through the stage's scheduler."""
    core = stage_module(stage, "core")
    sched = make_scheduler(stage, engine, **sched_kw)
    for i, (p, n) in enumerate(zip(prompts, new_tokens)):
        sched.add_request(core.Req(i, p, core.SamplingParams(max_new_tokens=n, ignore_eos=True)))
    outputs: dict[int, list] = {i: [] for i in range(len(prompts))}
    while sched.has_unfinished():
        for out in sched.step():
            outputs[out.rid].extend(out.new_token_ids)
    sched.worker.shutdown()
    return outputs


def nano_vllm_workload(num_requests: int, low: int, high: int, vocab: int, seed: int = 0):
    """nano-vllm's bench.py workload: prompt and output lengths uniform in [low, high], prompt tokens uniform in
    0..10000, drawn in the order its bench.py draws them, from Python's random seeded 0; run with ignore_eos
    (greedy here: it samples at temperature 0.6, the same work per token). -> (prompts, output lengths)."""
    rng = random.Random(seed)
    top = min(10000, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(low, high))] for _ in range(num_requests)]
    return prompts, [rng.randint(low, high) for _ in range(num_requests)]


@contextlib.contextmanager
def marking_steps(sched):
    """Each step's device work inside a profiler range named STEP_MARK (on a GPU the profiler also records the
    range's span on the device: its first kernel to its last), so the kernels of one step can be told from the
    next's."""
    submit = sched.worker.submit

    def marked(fn):
        def run():
            with torch.profiler.record_function(STEP_MARK):
                return fn()
        return submit(run)

    sched.worker.submit = marked
    try:
        yield
    finally:
        sched.worker.submit = submit


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


def idle_between(steps: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float | None:
    """Mean time (same unit) in which no kernel ran between the end of one step's device work and the start of
    the next's; None with fewer than two steps."""
    steps = sorted(steps)
    if len(steps) < 2:
        return None
    gaps = []
    for (_, end), (start, _) in zip(steps, steps[1:]):
        if start <= end:  # the next step's device work began before this one's ended: no gap
            gaps.append(0.0)
            continue
        inside = [(max(a, end), min(b, start)) for a, b in kernels if a < start and b > end]
        gaps.append(start - end - union_length(inside))
    return sum(gaps) / len(gaps)


def step_spans(events, kind, kernels: list[tuple[float, float]], steps: int) -> tuple[list, str]:
    """The device span of each profiled step, and how it was found: "marks", the STEP_MARK ranges the profiler
    recorded on the device (on a CPU: the ranges themselves); where a GPU profile has none, "equal runs", the
    kernels cut into `steps` runs of the same count (every decode step of one batch size launches the same
    kernels); failing that, "widest gaps", cut at the steps - 1 widest gaps between consecutive kernels."""
    marks = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP_MARK and e.device_type == kind]
    if marks or len(kernels) < steps:
        return sorted(marks), "marks"
    ordered = sorted(kernels)
    if len(ordered) % steps == 0:
        k = len(ordered) // steps
        cuts = list(range(k, len(ordered), k))
        how = "equal runs"
    else:
        gaps = sorted(range(1, len(ordered)), key=lambda i: ordered[i - 1][1] - ordered[i][0])[:steps - 1]
        cuts, how = sorted(gaps), "widest gaps"
    runs = [ordered[a:b] for a, b in zip([0] + cuts, cuts + [len(ordered)])]
    return [(run[0][0], max(end for _, end in run)) for run in runs], how


def all_threads():
    """The profiler's option to record every thread's ops, not only the caller's: with overlap the forward runs
    on the scheduler's device thread (None where this torch lacks the option)."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def timed_steps(sched, steps: int, dev: str) -> float:
    """Seconds for `steps` scheduler steps, the last one's device work finished."""
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sched.drain()
    sync(dev)
    return time.perf_counter() - start


def profile_steps(sched, steps: int, dev: str) -> dict:
    """Run `steps` more decode steps under torch.profiler -> busy: the fraction of their wall time in which some
    GPU kernel ran (overlapping ones counted once; CUDA events around a step would count the GPU's waits for
    launches as busy, the kernel records do not); idle_ms: the mean gap between one step's last kernel and the
    next step's first; top_kernels: the 5 with the most time (name, ms per step); kernels_per_step. The profiler
    adds a little CPU time to each launch, so without graphs the busy figure is a little low. On a CPU (--smoke)
    the records are torch's CPU ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.startswith("cuda")
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    with marking_steps(sched), profile(activities=activities, experimental_config=all_threads()) as prof:
        wall = timed_steps(sched, steps, dev)
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = prof.events()
    kernels = [e for e in events if e.device_type == kind and e.time_range.end > e.time_range.start
               and not getattr(e, "is_user_annotation", False) and e.name != STEP_MARK]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]  # microseconds
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    step_ranges, how = step_spans(events, kind, spans, steps)
    idle = idle_between(step_ranges, spans)
    return {"busy": union_length(spans) / 1e6 / wall, "idle_ms": None if idle is None else idle / 1e3,
            "idle_from": how, "top_kernels": [(name[:80], us / 1e3 / steps) for name, us in top],
            "kernels_per_step": len(kernels) / steps}


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1))
