"""%(prog)s --prompt "..." --prompt "..." --max-new-tokens 100 [--stream]"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from . import LLM, SamplingParams
from .server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__)
    parser.add_argument("--prompt", action="append", help="repeat for several requests")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap each prompt in the model's chat template (default on)")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--memory-report", action="store_true",
        help="print what the weights and the KV cache cost, then the load statistics")
    parser.add_argument("--quiet", action="store_true", help="no one-line load report")
    ServerArgs.add_cli_args(
        parser.add_argument_group("engine options (ServerArgs, server_args.py)"))
    args = parser.parse_args(argv)
    prompts = args.prompt or ["What is the capital of France? Answer in one paragraph.",
                              "Write a haiku about the sea.", "List three uses of a paperclip."]
    if args.log_interval:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
            stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos)
        llm = LLM.from_server_args(ServerArgs.from_cli_args(args), verbose=not args.quiet)
        if args.memory_report:
            print_memory_report(llm)
        inputs = [llm.apply_chat_template(p) if args.chat and p else p for p in prompts]
        start = time.perf_counter()
        if args.stream:  # requests interleave: show each delta tagged with its request
            texts, reasons, tokens = [""] * len(prompts), [None] * len(prompts), 0
            for chunk in llm.stream(inputs, params):
                texts[chunk.index] += chunk.text
                tokens += len(chunk.token_ids)
                reasons[chunk.index] = chunk.error or chunk.finish_reason
                if chunk.text:
                    sys.stdout.write(f"[{chunk.index}] {chunk.text!r}\n")
            results = None
        else:
            results = llm.generate(inputs, params)
        elapsed = time.perf_counter() - start
    # bad options, UnsupportedModelError, CheckpointError
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if results is not None:
        texts = [f"error: {r.error}" if r.error else r.text for r in results]
        reasons = [r.finish_reason for r in results]
        tokens = sum(r.completion_tokens for r in results)
    for prompt, text, reason in zip(prompts, texts, reasons):
        print(f"--- {prompt!r} (finish_reason={reason})\n{text}")
    print(
        f"\n[{len(prompts)} requests, {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} "
        "tokens/s, "
        f"attention backend {llm.engine.attn_backend.name}, {llm.engine.kv_plan.summary()}]"
    )


def print_memory_report(llm: LLM) -> None:
    report, stats, cfg = llm.engine.memory_report(), llm.engine.load_stats, llm.engine.config
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(
        f"model      {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} q / "
        f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab_size}, "
        f"tied={cfg.tie_word_embeddings}"
    )
    print(f"weights    {report.num_params / 1e6:.1f}M params, {mib(report.param_bytes)}: "
          + ", ".join(f"{d} {mib(b)}" for d, b in report.param_bytes_by_dtype.items()))
    print(
        f"KV cache   2 x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim} x "
        f"{report.kv_dtype} "
        f"= {report.kv_bytes_per_token} bytes/token; "
        f"{mib(report.kv_bytes_per_token * report.max_context_len)} at the "
        f"{report.max_context_len}-token context"
    )
    print(f"KV pool    {llm.engine.kv_plan.summary()}")
    print(f"loaded     {stats.tensors} tensors from {stats.files} file(s), {mib(stats.bytes_read)} "
          f"({', '.join(sorted(stats.checkpoint_dtypes))} on disk) in {stats.seconds:.2f} s\n")

if __name__ == "__main__":
    main()
