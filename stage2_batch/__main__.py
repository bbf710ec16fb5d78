"""%(prog)s --prompt "..." --prompt "..." --max-new-tokens 100 [--attention-backend
triton]"""

from __future__ import annotations

import argparse
import time

from . import LLM, SamplingParams
from .attention import BACKENDS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="short name or local HF folder")
    parser.add_argument("--prompt", action="append", help="repeat to batch several prompts")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap each prompt in the model's chat template (default on)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attention-backend", default=None, choices=BACKENDS,
                        help="default: triton on CUDA, torch on CPU")
    parser.add_argument("--max-batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    prompts = args.prompt or ["What is the capital of France? Answer in one paragraph.",
                              "Write a haiku about the sea.", "List three uses of a paperclip."]

    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, device=args.device, dtype=args.dtype,
                  attention_backend=args.attention_backend, max_batch_size=args.max_batch_size)
        inputs = [llm.apply_chat_template(p) if args.chat and p else p for p in prompts]
        start = time.perf_counter()
        results = llm.generate(inputs, params)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError, KeyError) as exc:
        parser.exit(2, f"error: {exc}\n")
    for prompt, result in zip(prompts, results):
        print(f"--- {prompt!r}")
        print(f"error: {result.error}" if result.error else result.text)
    total = sum(r.completion_tokens for r in results)
    print(
        f"\n[{len(results)} requests, {total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} "
        "tokens/s, "
        f"attention backend {llm.engine.attn_backend.name}]"
    )


if __name__ == "__main__":
    main()
