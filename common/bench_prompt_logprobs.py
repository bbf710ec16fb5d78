"""What prompt logprobs (`echo` with `logprobs`, stage 8) cost a prefill, against transformers.

    python -m common.bench prompt-logprobs [--model M] [--prompt-lens 128 512 2048] [--repeats 5]
                                           [--threads N]

For each prompt length, one request at a time through stage 8's LLM (radix cache off, so every run
computes its prompt): a plain prefill (the last position's logits only, then one token), the same
with logprob_start_len=0 (every position's logits, their log-softmax, each prompt token's logprob
and the top 5), and transformers' forward of the same ids with a log-softmax over every position
(what lm-eval's `hf` backend computes). Best of --repeats, after one warm-up run each, in wall
time and in the process's CPU time (all its threads: the steadier number on a machine that runs
other work too). The extra memory of a pass is its scored positions x vocab floats, twice (the
logits and their log-softmax), at most --chunked-prefill-size positions per pass.
"""

from __future__ import annotations

import random
import time


def bench_prompt_logprobs(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from common.models import resolve_model
    from stage8_server import LLM, SamplingParams
    from stage8_server.core import Req

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab = hf.config.vocab_size
    rng = random.Random(0)
    words = ("the engine keeps every key and value of a prompt in its cache so that a later token "
             "reads them instead of computing attention again over the whole sequence").split()
    rids = iter(range(10**9))
    print(f"prompt logprobs: {args.model}, float32, {torch.get_num_threads()} threads, "
          f"best of {args.repeats}")
    print("wall ms (CPU ms): plain prefill | + prompt logprobs | ratio | HF forward + log-softmax "
          "| max |error| vs HF | extra MiB per pass")
    pool = max(args.prompt_lens) + 64
    with LLM(path, verbose=False, disable_radix_cache=True, max_total_tokens=pool,
             chunked_prefill_size=args.chunked_prefill_size) as llm:
        for n in args.prompt_lens:
            text = " ".join(rng.choice(words) for _ in range(2 * n))
            ids = llm.tokenizer.encode(text)[:n]  # English text: what a multiple-choice task scores

            def prefill(start: int) -> tuple[float, float, Req]:
                req = Req(next(rids), list(ids), SamplingParams(max_new_tokens=1),
                          return_logprob=start >= 0, top_logprobs_num=5 if start >= 0 else 0,
                          logprob_start_len=start)
                t0, c0 = time.perf_counter(), time.process_time()
                llm.add_req(req)
                while not req.finished:
                    llm.step()
                return time.perf_counter() - t0, time.process_time() - c0, req

            def hf_forward() -> tuple[float, float, torch.Tensor]:
                t0, c0 = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    logits = hf(torch.tensor([ids])).logits[0].float()  # [n, vocab]
                    logprobs = torch.log_softmax(logits, -1)
                    chosen = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                return time.perf_counter() - t0, time.process_time() - c0, chosen

            wall, cpu, out = {}, {}, {}
            for name, fn in (("plain", lambda: prefill(-1)), ("logprobs", lambda: prefill(0)),
                             ("hf", hf_forward)):
                runs = [fn() for _ in range(args.repeats + 1)][1:]  # the first one warms up
                wall[name] = min(r[0] for r in runs) * 1e3
                cpu[name] = min(r[1] for r in runs) * 1e3
                out[name] = runs[-1][2]
            ours = torch.tensor([lp for lp, _ in out["logprobs"].input_token_logprobs])
            err = (ours - out["hf"]).abs().max().item()
            extra = 2 * min(n, args.chunked_prefill_size) * vocab * 4 / 2**20
            cells = [f"{wall[k]:.1f} ({cpu[k]:.1f})" for k in ("plain", "logprobs")]
            ratio = f"{wall['logprobs'] / wall['plain']:.2f} ({cpu['logprobs'] / cpu['plain']:.2f})"
            print(f"prompt {n:>5} tokens: {cells[0]} | {cells[1]} | {ratio} | "
                  f"{wall['hf']:.1f} ({cpu['hf']:.1f}) | {err:.1e} | {extra:.0f}")


def add_parser(sub) -> None:
    p = sub.add_parser("prompt-logprobs",
                       help="stage 8 prefill with and without prompt logprobs (echo) vs HF")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (1: CPU time measures the work even on a busy machine)")
    p.set_defaults(func=bench_prompt_logprobs)
