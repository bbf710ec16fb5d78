"""Checks that measure: where a stage's lesson is a speed-up, `check` also times it.

A correct scheduler that is no faster than static batching has missed stage 4's point. So after
`python -m common.exercises check N` finds every task of the stage passing, it times the learner's
engine against what its lesson replaces, and says by how much it passed or missed:

    continuous batching: 2.04x stage 2's static batch (needs >= 1.3x): passed by 57%

    python -m common.speed_checks N [--root WORKSPACE] [--speed] [--repeats R]   (one by hand)

Method: one fresh process per stage; both engines built once in it; one warm-up run each, then R
rounds (default 3) alternating baseline and learner, so a busy moment on the machine hits both
alike; the ratio is the baseline's best seconds over the learner's best. The workloads are small
(tiny-llama, a few seconds a run) and the thresholds sit far below what the course's own code
reaches, since a laptop or a shared CI machine is noisy; a learner's code that misses one is slower
than the reference by a wide margin, not by noise.

The checks, and the reference's ratio measured with `python -m common.speed_checks N` (best of 3,
one torch thread) on a machine with 2 CPU cores shared with three other jobs (load average 1-4),
torch 2.13 CPU, 2026-12:

- 4.continuous_batching: stage 4's scheduler against stage 2's static batch, 16 requests (a quarter
  of them 48 tokens out, the rest 4), at most 4 running. Reference: 1.91x-2.13x (6 runs); needs
  >= 1.3x. A copy whose admission waits for the running batch to drain (static batching again)
  measured 0.94x.
- 6.radix_cache: stage 6 with the radix cache against the cache off, 12 requests sharing a
  384-token prefix, 2 tokens out. Reference: 4.1x-5.3x (6 runs); needs >= 1.5x.
- 5.compiled_step (opt-in, `check 5 --speed`: compiling the decode step takes 10-60 s): the
  compiled CPU decode (`enable_torch_compile`, bucket 1, torch attention) against the eager step,
  one request, 48 tokens out. Reference: 1.12x-1.25x (3 runs): on a 3-layer model the lm_head and
  sampling, which compiling does not shorten, take most of a step. Needs >= 1.0x: it catches a
  compiled path that recompiles or falls back to eager at every step, not a small loss.
- 5.cuda_graph_replay (a GPU only): decode replayed from CUDA graphs against the eager step on
  CUDA, one request, 64 tokens out. Needs >= 1.2x (tiny-llama's decode on a GPU is launch-bound,
  which graphs remove); not measured on a GPU yet. On a CPU `check --json` reports it
  `"blocked": "needs a GPU"` with `passed: null`, never failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
BLOCKED_NO_GPU = "needs a GPU"
LABELS = {True: "FAST", False: "SLOW", None: "    "}  # check's line: passed, missed, not run


@dataclass(frozen=True)
class SpeedCheck:
    id: str  # "4.continuous_batching"
    title: str  # "continuous batching"
    baseline: str  # what it is timed against: "stage 2's static batch"
    threshold: float  # the ratio it needs, baseline seconds / learner seconds
    stage_name: str  # the learner's package
    # (learner's stage module) -> (run_baseline, run_learner): each runs the workload once
    build: Callable
    gpu: bool = False  # needs CUDA: blocked on a CPU, never failed
    opt_in: str = ""  # why it runs only with --speed (slow); "" runs by default

    @property
    def stage(self) -> int:
        return int(self.id.split(".")[0])


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _runner(stage, llm, prompts, max_new: list[int]):
    params = [stage.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]
    return lambda: llm.generate(prompts, params)


def _model() -> str:
    from common.models import resolve_model

    return str(resolve_model("tiny-llama"))


# ---------------------------------------------------------------- the workloads
def continuous_batching(stage4):
    """16 requests, a quarter of them 48 tokens out, the rest 4; 4 at a time. A static batch runs
    as long as its longest request (4 batches x 48 steps); continuous batching fills each freed
    row at once (about 60 steps)."""
    stage2 = importlib.import_module("stage2_batch")
    path, prompts = _model(), _prompts(16, 8, 24, seed=4)
    max_new = [48 if i % 4 == 0 else 4 for i in range(len(prompts))]
    static = stage2.LLM(path, attention_backend="torch", max_batch_size=4)
    mine = stage4.LLM(path, attention_backend="torch", max_running_requests=4, verbose=False)
    return _runner(stage2, static, prompts, max_new), _runner(stage4, mine, prompts, max_new)


def radix_cache(stage6):
    """12 requests sharing a 384-token prefix, each with its own 8 tokens, 2 tokens out: the cache
    prefills the prefix once (the tree starts empty at every run), the cache off twelve times."""
    path = _model()
    prefix = _prompts(1, 384, 384, seed=6)[0]
    prompts = [prefix + tail for tail in _prompts(12, 8, 8, seed=7)]
    options = dict(attention_backend="torch", max_running_requests=16, verbose=False)
    on = stage6.LLM(path, **options)
    off = stage6.LLM(path, disable_radix_cache=True, **options)
    run_on = _runner(stage6, on, prompts, [2] * len(prompts))

    def fresh_tree():
        on.scheduler.flush_cache()
        run_on()
    return _runner(stage6, off, prompts, [2] * len(prompts)), fresh_tree


def compiled_step(stage5):
    """One request, 48 tokens out: every decode step is batch 1, the compiled bucket."""
    path, prompts = _model(), _prompts(1, 16, 16, seed=5)
    options = dict(attention_backend="torch", disable_overlap=True, verbose=False)
    eager = stage5.LLM(path, **options)
    compiled = stage5.LLM(path, enable_torch_compile=True, torch_compile_max_bs=1, **options)
    return _runner(stage5, eager, prompts, [48]), _runner(stage5, compiled, prompts, [48])


def cuda_graph_replay(stage5):
    """One request on CUDA, 64 tokens out: every decode step replays bucket 1's graph."""
    path, prompts = _model(), _prompts(1, 16, 16, seed=5)
    options = dict(device="cuda", disable_overlap=True, cuda_graph_max_bs=1, verbose=False)
    eager = stage5.LLM(path, disable_cuda_graph=True, **options)
    graphs = stage5.LLM(path, **options)

    def synced(run):
        import torch

        def go():
            run()
            torch.cuda.synchronize()
        return go
    return (synced(_runner(stage5, eager, prompts, [64])),
            synced(_runner(stage5, graphs, prompts, [64])))


CHECKS = [
    SpeedCheck("4.continuous_batching", "continuous batching", "stage 2's static batch", 1.3,
               "stage4_scheduler", continuous_batching),
    SpeedCheck("5.compiled_step", "the compiled CPU step", "the eager step", 1.0,
               "stage5_cudagraph", compiled_step,
               opt_in="compiling the decode step takes 10-60 s: run `check 5 --speed`"),
    SpeedCheck("5.cuda_graph_replay", "CUDA-graph replay", "the eager step on CUDA", 1.2,
               "stage5_cudagraph", cuda_graph_replay, gpu=True),
    SpeedCheck("6.radix_cache", "the radix cache", "the cache off", 1.5, "stage6_radix",
               radix_cache),
]
BY_ID = {c.id: c for c in CHECKS}


def stage_checks(number: int) -> list[SpeedCheck]:
    return [c for c in CHECKS if c.stage == number]


# ---------------------------------------------------------------- measuring
def verdict(check: SpeedCheck, ratio: float) -> dict:
    """A measured ratio against the check's threshold, and the line that says it."""
    ratio = round(ratio, 3)  # the message says what the JSON holds
    passed = ratio >= check.threshold
    by = round(ratio / check.threshold - 1 if passed else 1 - ratio / check.threshold, 3)
    message = (f"{check.title}: {ratio:.2f}x {check.baseline} (needs >= {check.threshold}x): "
               f"{'passed' if passed else 'missed'} by {by:.0%}")
    return {"id": check.id, "passed": passed, "ratio": ratio, "threshold": check.threshold,
            "by": by, "message": message}


def not_run(check: SpeedCheck, key: str, reason: str) -> dict:
    """A check that did not run: `blocked` (the machine cannot: never a failure) or `skipped`."""
    return {"id": check.id, "passed": None, key: reason,
            "message": f"{check.title}: {key}: {reason}"}


def time_ratio(run_baseline, run_learner, repeats: int) -> tuple[float, list, list]:
    """Best baseline seconds / best learner seconds, alternating, after one warm-up run each."""
    run_baseline(), run_learner()
    base, mine = [], []
    for _ in range(repeats):
        for run, into in ((run_baseline, base), (run_learner, mine)):
            start = time.perf_counter()
            run()
            into.append(time.perf_counter() - start)
    return min(base) / min(mine), base, mine


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(check: SpeedCheck, root: Path | None, repeats: int) -> dict:
    """Run one check in this process, on the stage package found in `root` (None: the course's)."""
    if check.gpu and not has_gpu():
        return not_run(check, "blocked", BLOCKED_NO_GPU)
    stage = importlib.import_module(check.stage_name)
    expected = (root or ROOT) / check.stage_name
    here = Path(stage.__file__).resolve().parent
    if here != expected.resolve():
        raise RuntimeError(f"{check.stage_name} was imported from {here}, not from {expected}")
    try:
        ratio, base, mine = time_ratio(*check.build(stage), repeats)
    except Exception as e:  # the learner's engine crashed on the workload: a miss, said why
        return {**not_run(check, "error", f"{type(e).__name__}: {e}"), "passed": False}
    result = verdict(check, ratio)
    result["seconds"] = {"baseline": [round(s, 3) for s in base],
                         "learner": [round(s, 3) for s in mine]}
    return result


# ---------------------------------------------------------------- what `check` calls
def for_check(number: int, task_results: list[dict], all_tasks: bool, workspace: Path | None,
              speed: bool, verbose: bool = False) -> list[dict]:
    """The stage's speed checks after its tasks' tests: measured (in a fresh process) when the
    whole stage was checked and passed; else said why not."""
    checks = stage_checks(number)
    if not checks:
        return []
    results, todo = [], []
    for c in checks:
        if c.gpu and not has_gpu():
            results.append(not_run(c, "blocked", BLOCKED_NO_GPU))
        elif not all_tasks:
            results.append(not_run(c, "skipped", f"timed by `check {number}` (all your tasks)"))
        elif not all(r["passed"] for r in task_results):
            results.append(not_run(c, "skipped", "a task fails: speed is timed on working code"))
        elif c.opt_in and not speed:
            results.append(not_run(c, "skipped", c.opt_in))
        else:
            todo.append(c)
    if todo:
        results += run_in_subprocess(todo, workspace, verbose)
    order = [c.id for c in checks]
    return sorted(results, key=lambda r: order.index(r["id"]))


def run_in_subprocess(checks: list[SpeedCheck], workspace: Path | None, verbose: bool,
                      repeats: int = 3) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speed.json"
        paths = [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        cmd = [sys.executable, "-m", "common.speed_checks", *[c.id for c in checks],
               "--repeats", str(repeats), "--json-out", str(out)]
        if workspace is not None:
            cmd += ["--root", str(workspace)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=not verbose)
        if not out.exists():
            why = ((proc.stdout or "") + (proc.stderr or ""))[-1500:]
            return [{**not_run(c, "error", f"the timing run failed:\n{why}"), "passed": False}
                    for c in checks]
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.speed_checks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="+",
                        help="a stage number, or check ids (4.continuous_batching)")
    parser.add_argument("--root", help="a workspace folder holding the stage package (default: "
                                       "the course's)")
    parser.add_argument("--speed", action="store_true", help="include the opt-in (slow) checks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", help="write the results there (what `check` reads)")
    args = parser.parse_args(argv)
    checks = []
    for w in args.which:
        if w.isdigit():
            checks += [c for c in stage_checks(int(w)) if args.speed or not c.opt_in]
        elif w in BY_ID:
            checks.append(BY_ID[w])
        else:
            parser.error(f"no speed check {w!r}; they are: {', '.join(BY_ID)}")
    import torch

    # One thread: on a machine shared with other jobs, OpenMP threads that wait on each other turn
    # a busy moment into a 10x slower run; a tiny model gains nothing from a second thread.
    torch.set_num_threads(1)
    root = Path(args.root).resolve() if args.root else None
    if root is not None:  # the learner's package first: `import stage4_scheduler` finds it
        sys.path.insert(0, str(root))
    results = []
    for c in checks:
        results.append(measure(c, root, args.repeats))
        print(results[-1]["message"], flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["passed"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
