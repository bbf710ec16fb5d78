"""What structured outputs (stage 8) cost: compiling a grammar once, and the mask at every step.

    python -m common.bench grammar [--model M] [--device cpu|cuda] [--batch-sizes 1 32]
                                   [--max-new-tokens 64] [--repeats 3] [--temperature 0]
                                   [--threads N]

- compile: building xgrammar's TokenizerInfo (once per tokenizer), compiling a JSON schema cold,
  and the same schema again (a cache hit: GrammarBackend returns the Future it already holds).
- per step, at each batch size: the median decode step with every request under a JSON schema
  against the same batch unconstrained, in wall and in CPU time (the process's, all threads: the
  steadier number on a machine that runs other work too). Both run exactly --max-new-tokens tokens
  (the schema asks for a long array, so no request ends early); best of --repeats, interleaved.
  Then the host time to fill the batch's bitmask (one fill_next_token_bitmask per request,
  measured inside the scheduler), and the time to apply it to the logits
  (apply_token_bitmask_inplace on the device, every row constrained, timed alone over 50 calls).

On CUDA the overlap scheduler is on for the unconstrained batch; a constrained one reads each
step's tokens before it builds the next step's mask, so its step also pays the host work that
overlap would have hidden.
"""

from __future__ import annotations

import json
import math
import statistics
import time

SCHEMA = {"type": "object", "required": ["people"], "properties": {"people": {
    "type": "array", "minItems": 100, "items": {
        "type": "object", "required": ["name", "age"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}}}


def median_decode_step(llm, prompts, params, batch_size: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of the decode steps that ran the whole batch."""
    scheduler, times = llm.scheduler, []
    step = scheduler.step

    def timed_step():
        wall, cpu, before = time.perf_counter(), time.process_time(), len(scheduler.stats)
        out = step()
        if len(scheduler.stats) > before:  # this step ran a batch (record_stats logged it)
            stats = scheduler.stats[-1]
            if stats.phase == "decode" and stats.batch_size == batch_size:
                times.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    scheduler.step = timed_step
    try:
        results = llm.generate(prompts, params)
    finally:
        del scheduler.step  # the class's method again
    assert all(r.finish_reason == "length" for r in results), [r.finish_reason for r in results]
    return statistics.median(t for t, _ in times), statistics.median(c for _, c in times)


def timed(fn, record: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out
    return wrapper


def apply_seconds(backend, compiled, batch_size: int, device: str) -> float:
    """apply_token_bitmask_inplace on [B, vocab] float32 logits of `device`, every row constrained
    (a matcher at the start of the schema: only "{" may come, every other id is set to -inf)."""
    import torch

    from stage8_server.constrained import apply_grammar_mask

    logits = torch.randn(batch_size, backend.vocab_size, device=device)
    mask = backend.allocate_mask(batch_size)
    for row in range(batch_size):
        backend.matcher(compiled).fill_next_token_bitmask(mask, row)
    mask, rows = mask.to(device), list(range(batch_size))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):
        apply_grammar_mask(logits, mask, rows)
    sync()
    start = time.perf_counter()
    for _ in range(50):
        apply_grammar_mask(logits, mask, rows)
    sync()
    return (time.perf_counter() - start) / 50


def compile_times(backend, text: str) -> tuple[float, float, float]:
    """Seconds: TokenizerInfo + compiler, the schema cold, the schema again (the cache)."""
    times = []
    for job in (backend.compiler, lambda: backend.get_future(("json_schema", text)).result(),
                lambda: backend.get_future(("json_schema", text)).result()):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return tuple(times)


def bench_grammar(args) -> None:
    import torch

    from common.models import resolve_model
    from stage8_server import LLM, SamplingParams
    from stage8_server.constrained import GrammarBackend

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    text = json.dumps(SCHEMA)
    cuda = args.device.startswith("cuda")
    machine = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"grammar: {args.model}, {args.device} ({machine}), float32, {args.max_new_tokens} new "
          f"tokens per request, temperature {args.temperature}")
    batch_max = max(args.batch_sizes)
    with LLM(path, device=args.device, verbose=False, record_stats=True,
             max_running_requests=max(batch_max, 8),
             max_total_tokens=batch_max * (args.max_new_tokens + 64) + 1024) as llm:
        backend = GrammarBackend(llm.tokenizer.hf, llm.engine.config.vocab_size,
                                 llm.engine.eos_token_ids)
        info_s, cold_s, hit_s = compile_times(backend, text)
        compiled = backend.get_future(("json_schema", text)).result()
        backend.shutdown()
        print(f"compile: TokenizerInfo {1e3 * info_s:.0f} ms (once per tokenizer); this JSON "
              f"schema {1e3 * cold_s:.1f} ms cold, {1e3 * hit_s:.3f} ms from the cache")

        fills: list[float] = []
        grammars = llm.scheduler.grammars
        prompt = llm.apply_chat_template("List people with their names and ages, as JSON.")
        warm = SamplingParams(max_new_tokens=4, json_schema=text)
        llm.generate([prompt] * 2, [warm, SamplingParams(max_new_tokens=4)])  # compile, caches
        grammars.fill_mask = timed(grammars.fill_mask, fills)
        print("batch | decode step, wall ms (CPU ms): plain | JSON schema | extra CPU ms | mask "
              "fill ms/step (per request) | mask apply ms/step")
        for b in args.batch_sizes:
            plain = [SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=i,
                                    temperature=args.temperature) for i in range(b)]
            constrained = [SamplingParams(max_new_tokens=args.max_new_tokens, seed=i,
                                          temperature=args.temperature, json_schema=text)
                           for i in range(b)]
            best = {"plain": (math.inf, math.inf), "json": (math.inf, math.inf)}
            fills.clear()
            for _ in range(args.repeats):  # interleaved: the machine's noise hits both alike
                for name, params in (("plain", plain), ("json", constrained)):
                    wall, cpu = median_decode_step(llm, [prompt] * b, params, b)
                    best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
            (w_plain, c_plain), (w_json, c_json) = best["plain"], best["json"]
            fill = statistics.median(fills)
            apply = apply_seconds(backend, compiled, b, args.device)
            print(f"{b:>5} | {1e3 * w_plain:.1f} ({1e3 * c_plain:.1f}) | {1e3 * w_json:.1f} "
                  f"({1e3 * c_json:.1f}) | {1e3 * (c_json - c_plain):+.1f} "
                  f"({100 * (c_json / c_plain - 1):+.0f}%) | {1e3 * fill:.2f} "
                  f"({1e3 * fill / b:.3f}) | {1e3 * apply:.3f}")


def add_parser(sub) -> None:
    p = sub.add_parser("grammar",
                       help="stage 8 structured outputs: grammar compile, per-step mask cost")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (greedy): the steps differ by the mask alone; > 0 adds the sampler, "
                        "whose sort of the vocabulary is faster on a row that is mostly -inf")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (1: steadier numbers on a machine that runs other work)")
    p.set_defaults(func=bench_grammar)
