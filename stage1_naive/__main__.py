"""%(prog)s --prompt "..." --max-new-tokens 100"""

from __future__ import annotations

import argparse
import time

from . import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="short name or local HF folder")
    parser.add_argument("--prompt",
                        default="Write a short story about a robot who learns to paint.")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the model's chat template (default on)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache", default="static", choices=["static", "growing"])
    args = parser.parse_args(argv)

    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache=args.kv_cache)
        prompt = llm.apply_chat_template(args.prompt) if args.chat and args.prompt else args.prompt
        start = time.perf_counter()
        (result,) = llm.generate([prompt], params)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError, KeyError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(result.text)
    print(
        f"\n[{result.completion_tokens} tokens in {elapsed:.2f} s = "
        f"{result.completion_tokens / elapsed:.1f} "
        f"tokens/s; prompt {result.prompt_tokens} tokens; finish_reason={result.finish_reason}]"
    )


if __name__ == "__main__":
    main()
