"""What the benchmarks share: workloads, timing, the runs of our stages and of transformers, the report table and
the machine's copy bandwidth. `common/bench.py` (the command line) and every sub-benchmark import from here, never
from each other, so nothing imports in a circle.
"""

from __future__ import annotations

import importlib
import platform
import random
import time
from dataclasses import dataclass

import torch


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    max_new_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new_tokens)


def mixed_workload(tokenizer, num_requests: int, max_new_tokens: int, seed: int = 0,
                   vary_output: bool = False, min_prompt: int = 8, max_prompt: int = 256) -> Workload:
    """Prompts cut from varied English text, lengths uniform in [min_prompt, max_prompt]."""
    rng = random.Random(seed)
    words = ("the engine schedules requests into batches while the cache keeps keys and values of every token "
             "so that each decode step reads them instead of recomputing attention over the whole sequence").split()
    text_ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(4 * max_prompt)), add_special_tokens=False)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(min_prompt, max_prompt)
        start = rng.randrange(0, len(text_ids) - n)
        prompts.append(text_ids[start : start + n])
        outs.append(rng.randint(max(1, max_new_tokens // 4), max_new_tokens) if vary_output else max_new_tokens)
    return Workload(prompts, outs)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_stage(stage_name: str, llm, work: Workload, **generate_kwargs) -> tuple[float, list[list[int]]]:
    stage = importlib.import_module(stage_name)
    params = [stage.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in work.max_new_tokens]
    out: list = []
    seconds = timed(lambda: out.extend(llm.generate(work.prompts, params, **generate_kwargs)))
    return seconds, [r.token_ids for r in out]


def run_hf(hf_model, work: Workload, batch_size: int, pad_id: int) -> tuple[float, list[list[int]]]:
    """transformers `generate` on left-padded batches (its standard batched path)."""
    outputs: list[list[int]] = []

    def go():
        for i in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[i : i + batch_size]
            n = max(work.max_new_tokens[i : i + batch_size])
            width = max(map(len, prompts))
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=hf_model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf_model.device)
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id)
            for j, row in enumerate(out[:, width:].tolist()):
                outputs.append(row[: work.max_new_tokens[i + j]])

    return timed(go), outputs


def warm_up(work: Workload) -> Workload:
    """Two tokens for (at most) two of the workload's prompts: first calls pay for allocation and one-time setup."""
    return Workload(work.prompts[:2], [2] * len(work.prompts[:2]))


def fitting_tokens(work: Workload, page_size: int) -> int:
    """KV tokens (whole pages) that hold every request of the workload at once, prompt and output, as HF generate's
    one padded batch does."""
    return sum(-(-(len(p) + n) // page_size) for p, n in zip(work.prompts, work.max_new_tokens)) * page_size


def hf_cb_config(num_pages: int, page_size: int, max_running: int, max_prefill_tokens: int):
    """transformers' continuous batching sized like our engine: the same KV memory in pages of the same size, the
    same running-request and per-step token limits. Block sharing (its prefix cache) off: ours has none until stage
    6, and the warm-up's blocks would otherwise be reused by the measured run."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_pages,
                                    max_requests_per_batch=max_running, max_batch_tokens=max_prefill_tokens,
                                    allow_block_sharing=False)


def run_hf_cb(hf_model, work: Workload, cb_config) -> tuple[float, list[list[int]]]:
    """transformers' own continuous batching, the engine behind `model.generate_batch` (paged KV cache, a scheduler,
    the model's SDPA attention on the CPU). `generate_batch` takes one max_new_tokens for all prompts and our
    workload gives each its own, so this drives the same manager the way generate_batch does (its context manager,
    then one add_request per prompt), greedy, EOS ignored (eos_token_id=-1). The manager is kept between calls
    (persistent_manager), so its KV cache is allocated by the warm-up, as our engine's pool is at construction."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(work.max_new_tokens))
    outputs: list[list[int]] = []

    def go():
        with hf_model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb_config,
                                                          persistent_manager=True) as manager:
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
                   for p, n in zip(work.prompts, work.max_new_tokens)]
            done: dict = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped before finishing")
                    continue
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                if result.is_finished():
                    done[result.request_id] = list(result.generated_tokens)
        outputs.extend(done[i] for i in ids)

    return timed(go), outputs


def header(title: str) -> None:
    print(f"== {title}")
    print(f"   {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")


def report(rows: list[tuple[str, float]], tokens: int, peer: str) -> None:
    peer_tps = tokens / dict(rows)[peer]
    print(f"   {'system':44s} {'seconds':>8s} {'tokens/s':>9s} {'vs ' + peer:>14s}")
    for name, seconds in rows:
        tps = tokens / seconds
        print(f"   {name:44s} {seconds:8.2f} {tps:9.1f} {tps / peer_tps:13.2f}x")


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bandwidth_source(device: str, gib: float) -> torch.Tensor:
    """A `gib`-sized uint8 tensor whose every byte has been written. Reading a never-written CPU allocation measures
    nothing: its pages all map to the kernel's one shared zero page, which stays in cache, so a copy from it only
    pays for the writes (on a 2-vCPU EPYC: ~95 GB/s from such a source, ~55 GB/s from a written one)."""
    return torch.ones(int(gib * (1 << 30)), dtype=torch.uint8, device=device)


def copy_bandwidth(device: str, gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once, so 2 x size per copy)."""
    src = bandwidth_source(device, gib)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * repeats / (time.perf_counter() - start)
