"""python -m stage9_moe --model M --port 30000            serve the OpenAI-compatible API (the default)
python -m stage9_moe --prompt "..." [--prompt "..."] [--stream]   generate offline, as earlier stages did

Engine flags apply to both; sampling flags (--temperature, --stop, ...) to the offline run only: a server takes
them from each request."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from . import LLM, SamplingParams
from .attention import BACKENDS
from .distributed import TPError
from .llm import resolve_model_path, serve_node


OFFLINE_FLAGS = ("chat", "stream", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "stop", "seed", "ignore_eos", "memory_report")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stage9_moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name or local HF folder")
    parser.add_argument("--host", default="127.0.0.1", help="server: address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="server: port (0: any free port)")
    parser.add_argument("--served-model-name", default=None,
                        help="server: the model name clients send and /v1/models lists (default: --model)")
    parser.add_argument("--log-level", default="warning", help="server: uvicorn's log level")
    parser.add_argument("--prompt", action="append",
                        help="generate offline for this prompt instead of serving (repeat for several requests)")
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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                        help="weights and KV cache dtype, converted at load; auto = the checkpoint's own")
    parser.add_argument("--attention-backend", default=None, choices=BACKENDS,
                        help="default: triton on CUDA, torch on CPU")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool size in tokens (default: sized from memory)")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="memory share for weights + KV cache (default: 0.88 of a GPU; CPU: 0.25 of the "
                             "available RAM for the KV cache, at most 1 GiB)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--max-prefill-tokens", type=int, default=16384,
                        help="prefill batch limit when chunking is off (a longer first prompt still runs whole)")
    parser.add_argument("--chunked-prefill-size", type=int, default=512,
                        help="prefill tokens per batch; the prompt crossing it is cut into chunks (-1: no chunking)")
    parser.add_argument("--schedule-conservativeness", type=float, default=1.0,
                        help="scales the admission estimate new_token_ratio (higher: admit fewer, preempt less)")
    parser.add_argument("--log-interval", type=int, default=0, help="log throughput every N decode steps")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly on CUDA too")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=64, help="largest batch captured in a graph")
    parser.add_argument("--enable-torch-compile", action="store_true",
                        help="CPU: decode batches of up to --torch-compile-max-bs run torch.compile'd code, one graph "
                             "per bucket (compiling takes a while at start-up)")
    parser.add_argument("--torch-compile-max-bs", type=int, default=8, help="largest batch compiled")
    parser.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache (stage 5's engine)")
    parser.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"],
                        help="waiting-queue order within a priority: longest cached prefix first, or arrival order")
    parser.add_argument("--moe-runner-backend", default="auto", choices=["auto", "triton", "torch"],
                        help="MoE layers: fused Triton kernels (triton), the per-expert reference loop (torch); "
                             "auto = triton on CUDA, torch on CPU")
    parser.add_argument("--disable-overlap", action="store_const", const=True, default=None,
                        help="process each step's results before launching the next (stage 4's loop; the CPU default)")
    parser.add_argument("--enable-overlap", action="store_const", const=False, dest="disable_overlap",
                        help="overlap scheduling on a CPU too (on CUDA it is the default)")
    parser.add_argument("--memory-report", action="store_true",
                        help="print what the weights and the KV cache cost, then the load statistics")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor parallelism: ranks the model is split over")
    parser.add_argument("--nnodes", type=int, default=1, help="machines the tp ranks are spread over")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this machine's index; node 0 serves the requests, the others serve their ranks")
    parser.add_argument("--dist-init-addr", default=None, help="host:port where rank 0 listens (multi-node)")
    parser.add_argument("--enable-tp-sync-check", action="store_true",
                        help="compare every step's batch and sampled tokens across the tp ranks; raise where they "
                             "differ (a debugging guard: one gather per step)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights of the checkpoint's shapes (no weights read)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="loading progress bar (default: when stderr is a terminal)")
    parser.add_argument("--quiet", action="store_true", help="no one-line load report")
    args = parser.parse_args(argv)
    if args.log_interval:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    engine_args = dict(
        model=args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        page_size=args.page_size, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens, chunked_prefill_size=args.chunked_prefill_size,
        schedule_conservativeness=args.schedule_conservativeness, log_interval=args.log_interval,
        disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
        enable_torch_compile=args.enable_torch_compile, torch_compile_max_bs=args.torch_compile_max_bs,
        disable_overlap=args.disable_overlap, disable_radix_cache=args.disable_radix_cache,
        schedule_policy=args.schedule_policy, progress=args.progress, verbose=not args.quiet, tp_size=args.tp_size,
        nnodes=args.nnodes, dist_init_addr=args.dist_init_addr, load_format=args.load_format,
        enable_tp_sync_check=args.enable_tp_sync_check, moe_runner_backend=args.moe_runner_backend)
    if args.node_rank > 0:  # another machine's share of the tensor-parallel ranks: serve them until node 0 is done
        engine_args.pop("verbose")
        try:
            serve_node(node_rank=args.node_rank, record_stats=False, **engine_args)
        except (ValueError, FileNotFoundError, TPError) as exc:
            parser.exit(2, f"error: {exc}\n")
        return
    if not args.prompt:
        from .server.launch import launch_server  # FastAPI, uvicorn, zmq: needed only to serve

        offline_only = [f"--{name.replace('_', '-')}" for name in OFFLINE_FLAGS
                        if getattr(args, name) != parser.get_default(name)]
        if offline_only:
            parser.error(f"{', '.join(offline_only)}: for the offline run (with --prompt); a server takes sampling "
                         "parameters from each request")

        try:
            engine_args["model"] = resolve_model_path(args.model)  # every process loads the same folder
        except (ValueError, FileNotFoundError) as exc:
            parser.exit(2, f"error: {exc}\n")
        sys.exit(launch_server(engine_args, args.host, args.port, args.served_model_name or args.model,
                               args.log_level))
    run_offline(parser, args, engine_args)


def run_offline(parser: argparse.ArgumentParser, args: argparse.Namespace, engine_args: dict) -> None:
    prompts = args.prompt
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty, stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos)
        llm = LLM(**engine_args)
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
    except (ValueError, FileNotFoundError, TPError) as exc:  # UnsupportedModelError, CheckpointError included
        parser.exit(2, f"error: {exc}\n")
    if results is not None:
        texts = [f"error: {r.error}" if r.error else r.text for r in results]
        reasons = [r.finish_reason for r in results]
        tokens = sum(r.completion_tokens for r in results)
    for prompt, text, reason in zip(prompts, texts, reasons):
        print(f"--- {prompt!r} (finish_reason={reason})\n{text}")
    print(f"\n[{len(prompts)} requests, {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s, "
          f"attention backend {llm.engine.attn_backend.name}, {llm.engine.kv_plan.summary()}, CUDA graphs "
          f"{'on' if llm.engine.graph_runner else 'off'}, overlap {'on' if llm.scheduler.overlap else 'off'}, "
          f"prefix cache {'off' if llm.scheduler.cache.tree is None else 'on'}: hit rate "
          f"{100 * llm.scheduler.cache_hit_rate:.0f}%, tree {llm.scheduler.tree_tokens} tokens]")


def print_memory_report(llm: LLM) -> None:
    report, stats, cfg = llm.engine.memory_report(), llm.engine.load_stats, llm.engine.config
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"model      {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab_size}, tied={cfg.tie_word_embeddings}")
    print(f"weights    {report.num_params / 1e6:.1f}M params, {mib(report.param_bytes)}: "
          + ", ".join(f"{d} {mib(b)}" for d, b in report.param_bytes_by_dtype.items()))
    print(f"KV cache   2 x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim} x {report.kv_dtype} "
          f"= {report.kv_bytes_per_token} bytes/token; "
          f"{mib(report.kv_bytes_per_token * report.max_context_len)} at the {report.max_context_len}-token context")
    print(f"KV pool    {llm.engine.kv_plan.summary()}")
    print(f"loaded     {stats.tensors} tensors from {stats.files} file(s), {mib(stats.bytes_read)} "
          f"({', '.join(sorted(stats.checkpoint_dtypes))} on disk) in {stats.seconds:.2f} s\n")

if __name__ == "__main__":
    main()
