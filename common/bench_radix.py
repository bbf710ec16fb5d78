"""Stage 6's prefix cache against itself with the cache off and against HF transformers, in the same run.

    python -m common.bench radix [--model M] [--workloads shared multiturn random] [--repeats 1]
    python -m common.bench radix --device cuda --dtype bfloat16 --shape qwen3-0.6b   # GPU: random weights, that shape

Three workloads, greedy with ignore_eos so that every system produces the same number of tokens:
  shared     a ~512-token system prompt shared by 64 requests, each with its own 16-64-token question, 32 tokens out
  multiturn  16 conversations x 4 turns: each turn's prompt is the previous prompt + its answer + a new question
             (token ids concatenated, as the engine saw them), 32 tokens out per turn
  random     64 unrelated prompts of 64-256 tokens, 32 tokens out: nothing to share, so this measures the tree's cost
Each engine runs the same calls; the radix engine starts every workload with an empty tree. `--shape` builds a
random-weight checkpoint of that published shape (with SmolLM2's tokenizer, from tiny-llama) in a temporary folder,
for a GPU machine without the real model; its tokens mean nothing, and in bfloat16 the cached and uncached paths may
round differently, so there the token agreement is reported, not expected to be total.
"""

from __future__ import annotations

import dataclasses
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Run:
    seconds: float
    tokens: list[list[int]]  # every request's output, in call order
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # engine steps' forward + sample time, by phase


def _words(tokenizer, rng: random.Random, n: int) -> list[int]:
    vocab = ("the engine keeps every key and value of a shared prompt in a tree so that later requests read them "
             "instead of computing attention again over the same tokens for each new question they ask").split()
    ids = tokenizer.encode(" ".join(rng.choice(vocab) for _ in range(n)), add_special_tokens=False)
    return ids[:n]


def workload_calls(name: str, tokenizer, seed: int = 0):
    """A workload as a list of calls; a call is (prompts, max_new_tokens) or, for multi-turn, a function of the
    previous call's outputs."""
    rng = random.Random(seed)
    if name == "shared":
        system = _words(tokenizer, rng, 512)
        prompts = [system + _words(tokenizer, rng, rng.randint(16, 64)) for _ in range(64)]
        return [(prompts, 32)]
    if name == "random":
        return [([_words(tokenizer, rng, rng.randint(64, 256)) for _ in range(64)], 32)]
    if name == "multiturn":
        first = [_words(tokenizer, rng, rng.randint(64, 128)) for _ in range(16)]
        questions = [[_words(tokenizer, rng, rng.randint(16, 32)) for _ in range(16)] for _ in range(3)]

        def next_turn(turn: int):
            def build(prev_prompts, prev_outputs):
                return [p + o + q for p, o, q in zip(prev_prompts, prev_outputs, questions[turn])]
            return build

        return [(first, 32)] + [(next_turn(t), 32) for t in range(3)]
    raise ValueError(f"unknown workload {name!r}")


def run_calls(generate, calls) -> Run:
    """generate(prompts, max_new_tokens) -> (outputs, cached tokens, seconds by phase); multi-turn calls build on the
    previous."""
    outputs: list[list[int]] = []
    prompts: list[list[int]] = []
    seconds = cached = prompt_tokens = 0
    phases: dict[str, float] = {}
    prev_prompts, prev_outputs = None, None
    for spec, max_new in calls:
        batch = spec(prev_prompts, prev_outputs) if callable(spec) else spec
        start = time.perf_counter()
        outs, hit, split = generate(batch, max_new)
        seconds += time.perf_counter() - start
        cached += hit
        for phase, t in split.items():
            phases[phase] = phases.get(phase, 0.0) + t
        prompt_tokens += sum(map(len, batch))
        outputs += outs
        prompts += batch
        prev_prompts, prev_outputs = batch, outs
    return Run(seconds, outputs, sum(map(len, outputs)), prompt_tokens, cached, phases)


def engine_generate(llm, stage):
    def generate(prompts, max_new):
        llm.scheduler.timings.clear()
        results = llm.generate(prompts, stage.SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        split: dict[str, float] = {}
        for t in llm.scheduler.timings:  # record_stats: every step's forward + sample time
            split[t.phase] = split.get(t.phase, 0.0) + t.device_seconds
        return [r.token_ids for r in results], sum(r.cached_tokens for r in results), split
    return generate


def hf_generate(model, pad_id: int, batch_size: int):
    from common.bench_utils import Workload, run_hf

    def generate(prompts, max_new):
        _, outs = run_hf(model, Workload(prompts, [max_new] * len(prompts)), batch_size, pad_id)
        return outs, 0, {}
    return generate


def random_checkpoint(shape_name: str, folder: Path, device: str) -> Path:
    """A random-weight checkpoint of a published shape, with tiny-llama's (SmolLM2's) tokenizer files."""
    from common.bench_gpu_stage5 import ModelShape, build_checkpoint
    from common.models import copy_tokenizer, resolve_model

    tokenizer_source = resolve_model("tiny-llama")
    shapes = {"qwen3-0.6b": ModelShape.qwen3_0_6b, "llama3-8b": ModelShape.llama3_8b, "tiny": ModelShape.tiny}
    shape = shapes[shape_name]()
    vocab = json.loads((tokenizer_source / "config.json").read_text())["vocab_size"]
    build_checkpoint(dataclasses.replace(shape, vocab=max(shape.vocab, vocab)), folder, device)  # every token id fits
    copy_tokenizer(tokenizer_source, folder)
    return folder


def bench_radix(args) -> None:
    if args.shape:
        with tempfile.TemporaryDirectory() as tmp:
            run_bench_radix(args, random_checkpoint(args.shape, Path(tmp), args.device), f"{args.shape}-shape")
    else:
        from common.models import resolve_model

        run_bench_radix(args, resolve_model(args.model), args.model)


def run_bench_radix(args, path: Path, label: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import stage6_radix
    from common.bench_utils import header

    tok = AutoTokenizer.from_pretrained(str(path))
    header(f"prefix cache: {label}, {args.device} {args.dtype}, stage 6 with the radix cache on / off vs HF generate, "
           "greedy, ignore_eos")
    common = dict(device=args.device, dtype=args.dtype, max_running_requests=64, verbose=False, record_stats=True,
                  attention_backend="torch" if args.device == "cpu" else None)
    on = stage6_radix.LLM(str(path), **common)
    off = stage6_radix.LLM(str(path), disable_radix_cache=True, **common)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).to(args.device).eval()
    warm = [[1, 2, 3, 4]]
    for llm in (on, off):
        llm.generate(warm, stage6_radix.SamplingParams(max_new_tokens=2))
    rows = []
    for name in args.workloads:
        calls = workload_calls(name, tok)
        best: dict[str, Run] = {}
        for _ in range(args.repeats):  # interleaved: a busy moment on the machine hits every system alike
            on.scheduler.flush_cache()
            systems = {"radix": engine_generate(on, stage6_radix), "no cache": engine_generate(off, stage6_radix),
                       "HF generate": hf_generate(hf, tok.pad_token_id or 0, 64)}
            for system, gen in systems.items():
                run = run_calls(gen, calls)
                if system not in best or run.seconds < best[system].seconds:
                    best[system] = run
        base = best["no cache"]
        for system, run in best.items():
            rows.append((name, system, run, run.output_tokens / run.seconds, base.seconds / run.seconds))
        same_off = best["radix"].tokens == base.tokens
        same_hf = sum(a == b for a, b in zip(best["radix"].tokens, best["HF generate"].tokens))
        print(f"   {name}: {len(base.tokens)} requests, {base.prompt_tokens} prompt tokens, {base.output_tokens} "
              f"output tokens; radix == no cache: {same_off}; == HF for {same_hf}/{len(base.tokens)}")
        split = lambda r: ", ".join(f"{p} {t:.2f} s" for p, t in sorted(r.phase_seconds.items()))  # noqa: E731
        print(f"   {name}: forward + sample time by step kind: radix {split(best['radix'])}; no cache {split(base)}")
    print(f"   {'workload':10s} {'system':12s} {'seconds':>8s} {'tok/s':>7s} {'vs no cache':>12s} {'hit rate':>9s}")
    for name, system, run, tps, ratio in rows:
        hit = f"{run.cached_tokens / run.prompt_tokens:8.0%}" if system == "radix" else f"{'-':>8s}"
        print(f"   {name:10s} {system:12s} {run.seconds:8.2f} {tps:7.1f} {ratio:11.2f}x {hit}")


def add_parser(sub) -> None:
    p = sub.add_parser("radix", help="stage 6 prefix cache on vs off vs HF generate (shared, multi-turn, random)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workloads", nargs="+", default=["shared", "multiturn", "random"],
                   choices=["shared", "multiturn", "random"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shape", default=None, choices=["qwen3-0.6b", "llama3-8b", "tiny"],
                   help="random weights of this shape instead of --model (for a GPU machine; tiny: its CPU rehearsal)")
    p.set_defaults(func=bench_radix)
