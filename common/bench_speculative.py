"""Speculative decoding (stage 9, part 9.11): acceptance length and tokens/s against speculation off.

    python -m common.bench speculative                          # SmolLM2, NGRAM, batch 1 and 8, both workloads
    python -m common.bench speculative --algorithms NGRAM STANDALONE --draft-model tiny-llama

Two greedy workloads of 8 chat prompts each: "repeat/edit code" asks the model to rewrite a given function with a
small change (the output repeats its input: NGRAM's drafts are often right), "open questions" asks for new text
(little to copy: drafts are rare and mostly rejected). Batch 1 runs the prompts one at a time, batch 8 all together.
Each row: tokens emitted per request per verify pass (acceptance length: 1 = nothing accepted; without speculation
every step is 1), output tokens/s, the ratio to speculation off on the same prompts, and whether the tokens are
identical to speculation off (greedy must be exact).
"""

from __future__ import annotations

import importlib
import time

import torch

CODE = [
    ("def add(a, b):\n    return a + b\n", "rename it to plus"),
    ("def is_even(n):\n    if n % 2 == 0:\n        return True\n    return False\n", "rename n to number"),
    ("for i in range(10):\n    total = total + i * i\n    print(i, total)\n", "use j instead of i"),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n", "add a z field"),
    ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
     "rename xs to values"),
    ("items = ['apple', 'banana', 'cherry']\nfor item in items:\n    print(item.upper())\n",
     "add 'date' to the list"),
    ("def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n",
     "use an f-string"),
    ("def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result\n",
     "rename result to product"),
]
QUESTIONS = ["Why is the sky blue?", "Give three tips for sleeping better.", "What is a prime number?",
             "Describe a rainy day in a city.", "How do plants make food?", "What makes a good friend?",
             "Explain what a computer network is.", "Why do we have seasons?"]
WORKLOADS = {
    "repeat/edit code": [f"Rewrite this Python code and {change}. Output only the code.\n\n```python\n{code}```"
                         for code, change in CODE],
    "open questions": QUESTIONS,
}


def run(llm, stage, prompts: list[list[int]], batch: int, max_new_tokens: int) -> tuple[float, list[list[int]]]:
    params = stage.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    start, outputs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outputs += [r.token_ids for r in llm.generate(prompts[i : i + batch], params)]
    return time.perf_counter() - start, outputs


def bench_speculative(args) -> None:
    from common.models import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    stage = importlib.import_module(args.stage)
    path = str(resolve_model(args.model))
    configs = [("off", {})]
    for algorithm in args.algorithms:
        options = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": args.num_draft_tokens}
        if algorithm == "STANDALONE":
            options["speculative_draft_model_path"] = args.draft_model
        configs.append((algorithm, options))
    print(f"{args.stage}, {args.model}, {args.dtype}, greedy, up to {args.max_new_tokens} new tokens, "
          f"k = {args.num_draft_tokens} drafts, {torch.get_num_threads()} threads, best of {args.repeats}")
    print("| workload | batch | speculation | acceptance length | tok/s | x off | identical |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        results = {}  # (workload, config) -> (seconds, outputs)
        for name, options in configs:
            llm = stage.LLM(path, dtype=args.dtype, max_running_requests=batch, verbose=False, **options)
            for workload, texts in WORKLOADS.items():
                prompts = [llm.apply_chat_template(t) for t in texts]
                run(llm, stage, prompts[:1], 1, 8)  # warm-up
                worker = llm.scheduler.speculative
                best = None
                for _ in range(args.repeats):
                    if worker is not None:
                        worker.num_verify_rows = worker.num_accepted = 0
                    llm.flush_cache()  # every repeat computes its prompts
                    seconds, outputs = run(llm, stage, prompts, batch, args.max_new_tokens)
                    best = min(best or seconds, seconds)
                accept = f"{worker.acceptance_length:.2f}" if worker is not None else "1.00"
                tokens = sum(len(o) for o in outputs)
                results[workload, name] = (best, outputs)
                off_seconds, off_outputs = results[workload, "off"]
                print(f"| {workload} | {batch} | {name} | {accept} | {tokens / best:.1f} | "
                      f"{off_seconds / best:.2f}x | {'yes' if outputs == off_outputs else 'NO'} |", flush=True)
            llm.close()


def add_parser(sub) -> None:
    p = sub.add_parser("speculative", help="stage 9 speculative decoding: acceptance length, tok/s vs off")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--stage", default="stage9_moe")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--algorithms", nargs="+", default=["NGRAM"], choices=["NGRAM", "STANDALONE"])
    p.add_argument("--draft-model", default=None, help="STANDALONE: the draft model (same vocabulary)")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=bench_speculative)
