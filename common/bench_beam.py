"""Beam search's pages: k beams of one prompt against k separate requests (stage 6, part 6.6).

    python -m common.bench_beam                      # SmolLM2, the golden ~400-token prompt, 16 tokens
    python -m common.bench_beam --model tiny-llama --widths 2 4 --page-sizes 1 16

For each beam width k and page size: the tokens the engine computed and the KV pages the search left
in the radix tree (every beam it explored, pruned ones included: nothing else ran), against k
separate requests for the same prompt and length with the cache off (the tokens they computed and
the pages they held at their peak). Counts, not timings: any machine gives the same numbers.
"""

from __future__ import annotations

import argparse
import importlib


def measure(stage, path: str, prompt: list[int], k: int, n: int, page_size: int) -> dict:
    beam = stage.LLM(path, page_size=page_size, record_stats=True, verbose=False)
    beam.beam_search([prompt], k, n)
    beam.scheduler.check_integrity()
    beam_tokens = sum(s.num_tokens for s in beam.scheduler.stats)
    beam_pages = beam.scheduler.tree_tokens // page_size
    beam.close()
    separate = stage.LLM(path, page_size=page_size, record_stats=True, verbose=False,
                         disable_radix_cache=True)
    separate.generate([prompt] * k, stage.SamplingParams(max_new_tokens=n, ignore_eos=True))
    stats = separate.scheduler.stats
    sep_tokens, sep_pages = sum(s.num_tokens for s in stats), max(s.used_pages for s in stats)
    separate.close()
    return {"k": k, "page_size": page_size, "beam_tokens": beam_tokens, "beam_pages": beam_pages,
            "sep_tokens": sep_tokens, "sep_pages": sep_pages}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.bench_beam", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--stage", default="stage6_radix")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from common.golden import prompt_specs
    from common.models import resolve_model

    path = str(resolve_model(args.model))
    spec = next(s for s in prompt_specs(AutoTokenizer.from_pretrained(path)) if s["name"] == "long")
    prompt = spec["input_ids"]
    stage = importlib.import_module(args.stage)
    print(f"{args.stage}, {args.model}, prompt {len(prompt)} tokens, {args.max_new_tokens} new "
          "tokens per hypothesis")
    print("| k | page size | beams: tokens computed | beams: pages | k requests: tokens computed "
          "| k requests: peak pages | pages saved |")
    print("|---|---|---|---|---|---|---|")
    for page_size in args.page_sizes:
        for k in args.widths:
            r = measure(stage, path, prompt, k, args.max_new_tokens, page_size)
            print(f"| {k} | {page_size} | {r['beam_tokens']} | {r['beam_pages']} | "
                  f"{r['sep_tokens']} | {r['sep_pages']} | "
                  f"{1 - r['beam_pages'] / r['sep_pages']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
