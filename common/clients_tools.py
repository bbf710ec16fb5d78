"""clients_check's rows for langchain-openai, litellm, guidellm and aiperf.

langchain and litellm run in this process; guidellm and aiperf are command-line tools, run as
subprocesses (`python -m guidellm`, `python -m aiperf`) with a time limit, their JSON reports read
back. aiperf is the one tool run without HF_HUB_OFFLINE: in offline mode (0.13) it looks a tokenizer
up in the Hub's cache even when given a local folder, and fails; online, a local folder is loaded
directly, so nothing is fetched either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .clients_check import Context, check, need
from .clients_openai import MESSAGES, short

TOOL_TIMEOUT_S = 1200  # a benchmark on a busy 2-core machine is slow; a hung one still ends
BENCH_REQUESTS, BENCH_PROMPT_TOKENS, BENCH_OUTPUT_TOKENS = 8, 64, 32
AIPERF_REQUESTS, AIPERF_OUTPUT_TOKENS = 4, 16


def run_tool(
    args: list[str], env: dict | None = None, log_name: str = "tool.log", ctx: Context | None = None
):
    """Run `python -m <tool> ...`; its output goes to a log in the work folder; a non-zero exit is a
    FAIL quoting the end of that log."""
    log = ctx.workdir / log_name
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env or os.environ.copy(),
                cwd=ctx.workdir,
                timeout=TOOL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{args[0]} did not finish within {TOOL_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        lines = [
            line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()
        ]
        last = lines[-1][-300:] if lines else "no output"  # a traceback's last line: the error
        raise AssertionError(f"{args[0]} exited with {proc.returncode}: {last} (log: {log.name})")


# ---------------------------------------------------------------- langchain-openai
def chat_model(ctx: Context, **kwargs):
    need("langchain_openai", "langchain-openai")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{ctx.url}/v1",
        api_key="x",
        model=ctx.model,
        temperature=0,
        max_retries=0,
        timeout=600,
        **kwargs,
    )


def person_model():
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""

        name: str = Field(description="the person's first name")
        age: int = Field(description="the age in years")

    return Person


@check("langchain", "ChatOpenAI.invoke")
def lc_invoke(ctx: Context) -> str:
    msg = chat_model(ctx, max_tokens=16).invoke(MESSAGES[0]["content"])
    assert isinstance(msg.content, str) and msg.content, f"no content: {msg!r}"
    usage = msg.usage_metadata or {}
    assert usage.get("output_tokens", 0) >= 1, f"usage_metadata {usage}"
    ctx.memo["langchain"] = msg.content
    return f"{usage['input_tokens']} + {usage['output_tokens']} tokens: {short(msg.content)}"


@check("langchain", "ChatOpenAI.stream")
def lc_stream(ctx: Context) -> str:
    chunks = list(chat_model(ctx, max_tokens=16).stream(MESSAGES[0]["content"]))
    text = "".join(c.content for c in chunks)
    expected = ctx.memo.get("langchain")
    if expected is None:
        expected = chat_model(ctx, max_tokens=16).invoke(MESSAGES[0]["content"]).content
    assert text == expected, f"streamed {short(text)} != invoke {short(expected)}"
    return f"{len(chunks)} chunks, the same text as invoke"


def structured(ctx: Context, method: str) -> str:
    Person = person_model()
    runnable = chat_model(ctx, max_tokens=64).with_structured_output(Person, method=method)
    person = runnable.invoke("Invent a person: give a name and an age.")
    assert isinstance(person, Person), f"got {person!r}"
    return f"{person!r}"


@check("langchain", 'with_structured_output(Person, method="json_schema")')
def lc_json_schema(ctx: Context) -> str:
    return structured(ctx, "json_schema")


@check("langchain", 'with_structured_output(Person, method="function_calling")')
def lc_function_calling(ctx: Context) -> str:
    return structured(ctx, "function_calling")


# ---------------------------------------------------------------- litellm
def litellm_completion(ctx: Context, **kwargs):
    need("litellm")
    import litellm

    litellm.telemetry = False
    return litellm.completion(
        model=f"openai/{ctx.model}",
        api_base=f"{ctx.url}/v1",
        api_key="x",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        timeout=600,
        **kwargs,
    )


@check("litellm", 'completion(model="openai/<name>")')
def litellm_plain(ctx: Context) -> str:
    r = litellm_completion(ctx)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens >= 1, r
    ctx.memo["litellm"] = text
    return f"{r.usage.prompt_tokens} + {r.usage.completion_tokens} tokens: {short(text)}"


@check("litellm", 'completion(model="openai/<name>", stream=True)')
def litellm_stream(ctx: Context) -> str:
    chunks = list(litellm_completion(ctx, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = ctx.memo.get("litellm") or litellm_completion(ctx).choices[0].message.content
    assert text == expected, f"streamed {short(text)} != not streamed {short(expected)}"
    return f"{len(chunks)} chunks, the same text as not streamed"


# ---------------------------------------------------------------- guidellm
@check(
    "guidellm",
    f"run: synchronous, {BENCH_REQUESTS} requests, {BENCH_PROMPT_TOKENS} in / "
    f"{BENCH_OUTPUT_TOKENS} out",
)
def guidellm_run(ctx: Context) -> str:
    need("guidellm")
    report = ctx.workdir / "guidellm.json"
    run_tool(
        [
            "guidellm",
            "run",
            "--backend",
            f"kind=openai_http,target={ctx.url},model={ctx.model}",
            "--profile",
            "kind=synchronous",
            "--constraint",
            f"kind=max_requests,count={BENCH_REQUESTS}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={BENCH_PROMPT_TOKENS},"
            f"output_tokens={BENCH_OUTPUT_TOKENS}",
            "--tokenizer",
            f"kind=huggingface_auto,model={ctx.model_path}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        log_name="guidellm.log",
        ctx=ctx,
    )
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    assert (
        totals["successful"] == BENCH_REQUESTS
        and totals["errored"] == 0
        and totals["incomplete"] == 0
    ), totals
    out = metrics["output_token_count"]["successful"]["total_sum"]
    assert out == BENCH_REQUESTS * BENCH_OUTPUT_TOKENS, f"{out} output tokens"

    def median(name: str) -> float:
        return metrics[name]["successful"]["median"]

    return (
        f"{totals['successful']}/{BENCH_REQUESTS} ok, {out:.0f} output tokens; median TTFT "
        f"{median('time_to_first_token_ms'):.0f} ms, ITL {median('inter_token_latency_ms'):.0f} ms"
    )


# ---------------------------------------------------------------- aiperf
@check("aiperf", f"profile: chat, streamed, {AIPERF_REQUESTS} requests, concurrency 1")
def aiperf_profile(ctx: Context) -> str:
    need("aiperf")
    art = ctx.workdir / "aiperf"
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    run_tool(
        [
            "aiperf",
            "profile",
            "--model",
            ctx.model,
            "--url",
            ctx.url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--request-count",
            str(AIPERF_REQUESTS),
            "--concurrency",
            "1",
            "--isl",
            str(BENCH_PROMPT_TOKENS),
            "--osl",
            str(AIPERF_OUTPUT_TOKENS),
            "--extra-inputs",
            "ignore_eos:true",
            "--tokenizer",
            str(ctx.model_path),
            "--artifact-dir",
            str(art),
            "--ui-type",
            "none",
            "--no-server-metrics",
            "--no-gpu-telemetry",
            "--workers-max",
            "1",
            "--record-processors",
            "1",
            "--random-seed",
            "0",
        ],
        env=env,
        log_name="aiperf.log",
        ctx=ctx,
    )
    report = json.loads((art / "profile_export_aiperf.json").read_text())
    count = report["request_count"]["avg"]
    errors = (report.get("error_request_count") or {}).get("avg", 0)
    assert (
        count == AIPERF_REQUESTS and not errors
    ), f"{count} requests, {errors} errors: {report.get('error_summary')}"
    # The server's usage, not aiperf's own count: it re-tokenizes the text, which can differ by one.
    osl = report["usage_completion_tokens"]["avg"]
    assert (
        osl == AIPERF_OUTPUT_TOKENS
    ), f"usage says {osl} tokens, asked {AIPERF_OUTPUT_TOKENS} (ignore_eos)"
    return (
        f"{count:.0f}/{AIPERF_REQUESTS} ok, {osl:.0f} tokens each; TTFT "
        f"{report['time_to_first_token']['p50']:.0f} ms, "
        f"ITL {report['inter_token_latency']['p50']:.0f} ms (p50)"
    )
