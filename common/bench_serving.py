"""Online serving benchmark (SGLang's bench_serving, in small): stage 8's server against `transformers serve`
(with and without --continuous-batching) on the same model, prompts and client, in the same run.

    python -m common.bench serving [--model M] [--num-prompts 24] [--input-len 256] [--output-len 32]
                                   [--request-rates 1 4 inf] [--systems stage8 hf hf-cb] [--out DIR]

Each system is started on a free 127.0.0.1 port, warmed up with one request, measured at every request rate
(Poisson arrivals; `inf` sends every request at once: maximum concurrency), then stopped before the next starts,
so they never share the CPU. Requests are streaming /v1/completions, greedy, with the output length forced
(stage 8: ignore_eos; transformers: a generation_config with min_new_tokens), so every system generates the same
tokens' worth of work. Metrics carry bench_serving's names: request / input / output token throughput; TTFT (time
to first token), ITL (inter-token latency: between streamed chunks), TPOT (time per output token after the first)
and E2E latency, as mean / median / p99 in ms. Latency against request rate is plotted to DIR.

`transformers serve` loads its model with a device_map, which needs the `accelerate` package
(pip install -e ".[bench]"). stage8-overlap is the same server with --enable-overlap
(on a CPU the default is the synchronous loop; on CUDA, overlap).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMS = ("stage8", "stage8-overlap", "hf", "hf-cb")
LABELS = {"stage8": "stage 8 server", "stage8-overlap": "stage 8 server --enable-overlap",
          "hf": "transformers serve", "hf-cb": "transformers serve --continuous-batching"}
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600


@dataclass
class Request:
    prompt: str
    output_len: int


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[Request]:
    """Prompts of input_len * [range_ratio, 1] tokens cut from English text (bench_serving's "random" dataset keeps
    lengths random the same way), each asking for output_len * [range_ratio, 1] tokens."""
    rng = random.Random(seed)
    words = ("the server streams tokens to many clients while the scheduler batches their requests and the cache "
             "keeps the keys and values of every prompt so that shared prefixes are computed only once").split()
    text = " ".join(rng.choice(words) for _ in range(2 * input_len * num))
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # longer than the model: only cut from
    out = []
    for _ in range(num):
        n = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        start = rng.randrange(0, len(ids) - n)
        out.append(Request(tokenizer.decode(ids[start : start + n]),
                           rng.randint(max(1, int(output_len * range_ratio)), output_len)))
    return out


def request_body(system: str, model: str, req: Request) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0, "stream": True}
    if system.startswith("stage8"):
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    else:  # transformers serve refuses unknown fields; it takes a whole generation_config instead
        body["generation_config"] = json.dumps({"max_new_tokens": req.output_len, "min_new_tokens": req.output_len,
                                                "do_sample": False})
    return body


async def send(client, url: str, body: dict, tokenizer) -> Result:
    res, text, last = Result(), "", 0.0
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                delta = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if delta:
                    now = time.perf_counter()
                    if not text:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    text, last = text + delta, now
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = repr(exc)[:200]
        return res
    res.e2e = time.perf_counter() - start
    if not res.output_tokens:  # no usage reported: count as bench_serving does, by re-tokenizing
        res.output_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    if not res.prompt_tokens:
        res.prompt_tokens = len(tokenizer.encode(body["prompt"], add_special_tokens=False))
    res.ok = bool(text)
    res.error = "" if res.ok else "no text"
    return res


async def run_rate(system: str, url: str, model: str, requests: list[Request], rate: float,
                   max_concurrency: int | None, tokenizer, seed: int) -> tuple[list[Result], float]:
    """Poisson arrivals at `rate` requests/s (inf: all at once), at most max_concurrency in flight. Every rate sends
    the same requests, so a stage 8 server's prefix cache is emptied first (POST /flush_cache): otherwise each rate
    after the first would find its prompts cached and skip their prefill, which `transformers serve` cannot."""
    import httpx

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(requests) + 4)) as client:
        if system.startswith("stage8"):
            (await client.post(f"{url}/flush_cache", timeout=REQUEST_TIMEOUT_S)).raise_for_status()
        async def one(req: Request, delay: float) -> Result:
            await asyncio.sleep(delay)
            async with limit:
                return await send(client, url, request_body(system, model, req), tokenizer)

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))
        return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: [1e3 * x for x in xs]  # noqa: E731
    series = {"TTFT": ms([r.ttft for r in ok]), "ITL": ms([x for r in ok for x in r.itl]),
              "TPOT": ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
              "E2E Latency": ms([r.e2e for r in ok])}
    m = {"Successful requests": len(ok), "Benchmark duration (s)": duration,
         "Total input tokens": sum(r.prompt_tokens for r in ok),
         "Total generated tokens": sum(r.output_tokens for r in ok),
         "Request throughput (req/s)": len(ok) / duration,
         "Input token throughput (tok/s)": sum(r.prompt_tokens for r in ok) / duration,
         "Output token throughput (tok/s)": sum(r.output_tokens for r in ok) / duration}
    for name, xs in series.items():
        m[f"Mean {name} (ms)"] = statistics.fmean(xs) if xs else float("nan")
        m[f"Median {name} (ms)"] = percentile(xs, 0.5)
        m[f"P99 {name} (ms)"] = percentile(xs, 0.99)
    m["errors"] = sorted({r.error for r in results if not r.ok})
    return m


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, model_path: Path, port: int, stage: str) -> list[str]:
    if system.startswith("stage8"):
        return [sys.executable, "-m", stage, "--model", str(model_path), "--port", str(port), "--quiet",
                "--served-model-name", str(model_path)] + (["--enable-overlap"] if system == "stage8-overlap" else [])
    cmd = ["transformers", "serve", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--log-level", "error"]
    return cmd + (["--continuous-batching"] if system == "hf-cb" else [])


@contextmanager
def running(system: str, model_path: Path, stage: str, log_dir: Path):
    """Start one system, wait until it answers, yield its URL; SIGTERM (then SIGKILL) it on the way out."""
    import httpx

    port = free_port()
    log = open(log_dir / f"{system}.log", "w")
    proc = subprocess.Popen(server_command(system, model_path, port, stage), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: stopping it stops its children
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                hint = ' (transformers serve needs accelerate: pip install -e ".[bench]")' if system.startswith("hf") else ""
                raise RuntimeError(f"{system} exited with {proc.returncode}; see {log.name}{hint}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system} did not start within {START_TIMEOUT_S} s; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def print_table(rate: float, by_system: dict[str, dict]) -> None:
    names = list(by_system)
    print(f"\n== request rate {'inf (max concurrency)' if math.isinf(rate) else f'{rate:g} req/s'}")
    print(f"   {'metric':34s}" + "".join(f"{n:>19s}" for n in names))
    for key in [k for k in next(iter(by_system.values())) if k != "errors"]:
        print(f"   {key:34s}" + "".join(f"{by_system[n][key]:19.1f}" for n in names))
    for n in names:
        if by_system[n]["errors"]:
            print(f"   {n} errors: {by_system[n]['errors'][:3]}")


def plot(rates: list[float], table: dict[str, dict[float, dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in rates if not math.isinf(r)]
    x_of = {r: (r if not math.isinf(r) else 2 * max(finite, default=1)) for r in rates}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("Median TTFT (ms)", "Median ITL (ms)", "Median E2E Latency (ms)")):
        for system, by_rate in table.items():
            ax.plot([x_of[r] for r in rates], [by_rate[r][metric] for r in rates], "o-", label=LABELS[system])
        ax.set_xticks([x_of[r] for r in rates], ["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path = out / "serving_latency_vs_rate.png"
    fig.savefig(path, dpi=120)
    return path


def bench_serving(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from common.models import resolve_model

    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    requests = make_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                             args.seed)
    rates = [float(r) for r in args.request_rates]
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-serving-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"== serving: {args.model}, {len(requests)} requests per rate, prompts {int(args.input_len * args.range_ratio)}"
          f"-{args.input_len} tokens, outputs {int(args.output_len * args.range_ratio)}-{args.output_len} tokens, "
          f"rates {args.request_rates}, max concurrency {args.max_concurrency or 'unlimited'}")
    print(f"   {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, logs in {out}")
    table: dict[str, dict[float, dict]] = {}
    for system in args.systems:
        with running(system, model_path, args.stage, out) as url:
            asyncio.run(run_rate(system, url, str(model_path), requests[:1], math.inf, None, tokenizer, 0))  # warm up
            table[system] = {}
            for rate in rates:
                results, duration = asyncio.run(run_rate(system, url, str(model_path), requests, rate,
                                                         args.max_concurrency, tokenizer, args.seed))
                table[system][rate] = summarize(results, duration)
                print(f"   {LABELS[system]} @ {rate:g} req/s: {duration:.1f} s", flush=True)
    for rate in rates:
        print_table(rate, {s: table[s][rate] for s in table})
    top, moderate = max(rates), sorted(rates)[len(rates) // 2 - (len(rates) % 2 == 0)]
    for ours in [s for s in table if s.startswith("stage8")]:
        for peer in [s for s in table if s.startswith("hf")]:
            tput = table[ours][top]["Output token throughput (tok/s)"] / table[peer][top][
                "Output token throughput (tok/s)"]
            ttft = table[peer][moderate]["Median TTFT (ms)"] / table[ours][moderate]["Median TTFT (ms)"]
            print(f"   {LABELS[ours]} vs {LABELS[peer]}: output token throughput at rate {top:g}: {tput:.2f}x; "
                  f"median TTFT at rate {moderate:g}: {ttft:.2f}x lower")
    (out / "serving.json").write_text(json.dumps({s: {str(r): m for r, m in t.items()} for s, t in table.items()},
                                                 indent=1))
    print(f"   plot: {plot(rates, table, out)}")


def add_parser(sub) -> None:
    p = sub.add_parser("serving", help="stage 8 server vs transformers serve (bench_serving-style online benchmark)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--stage", default="stage8_server", help="the stage package whose server is measured")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths are uniform in [ratio * len, len]")
    p.add_argument("--request-rates", nargs="+", default=["1", "4", "inf"],
                   help="Poisson arrival rates in requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for the plot, the JSON results and the servers' logs")
    p.set_defaults(func=bench_serving)
