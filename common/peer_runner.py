"""Run one peer engine on a workload and write what it measured as JSON. Started by common/bench_peers.py with the
python of the peer's own environment (vLLM and llama-cpp-python pin their own builds), so it imports nothing from
the course, only the standard library and that peer:

    PEER_PYTHON common/peer_runner.py vllm|llama.cpp REQUEST.json RESULT.json [TO_PARENT_FD FROM_PARENT_FD]

REQUEST: {"model": HF folder, "gguf": GGUF file (llama.cpp), "dtype": "float32"|"bfloat16", "threads": int,
          "offline": {"prompts": [[ids]], "max_new_tokens": [int]} or null,
          "batch1": {"prompt": [ids], "new_tokens": int} or null, "warmup": {"prompts": ..., "max_new_tokens": ...},
          "repeats": int}
RESULT:  {"startup_s", "offline": {"seconds": [..], "token_ids": [[..]]}, "batch1": {"prefill_s", "decode_s": [..],
          "copy_bandwidth": [..], "token_ids": [..]}}
Timing, as for the course's engines: only the generate calls, after a warm-up; batch-1 decode is
(time to generate 1 + n tokens - time to generate 1 token) / n, which leaves the prompt's prefill out. With the two
file descriptors of a pipe to and from the parent, each batch-1 run also gets the machine's copy bandwidth beside
it: the parent measures it right before and right after the run (the mean is kept), while this process waits.
"""

from __future__ import annotations

import json
import os
import sys
import time


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


class VLLMPeer:
    def __init__(self, req: dict):
        from vllm import LLM

        # "defaults": vLLM as a new user runs it (prefix caching on); else as tuned runs compare it
        options = {} if req.get("defaults") else {"enable_prefix_caching": False}
        self.llm = LLM(model=req["model"], dtype=req["dtype"], seed=0, **options)

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new_tokens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def forget_prompts(self) -> None:  # a repeat of the workload must not find it in the prefix cache
        self.llm.reset_prefix_cache()


class LlamaCppPeer:
    """llama-cpp-python's Llama runs one sequence: an offline batch is not what it is for, batch-1 decode is."""

    def __init__(self, req: dict):
        from llama_cpp import Llama

        # use_extra_bufts=False: the AMX repacking path dies with an illegal instruction on some VMs that advertise
        # AMX; an F32 GGUF does not use it anyway.
        self.llm = Llama(model_path=req["gguf"], n_ctx=4096, n_batch=512, n_threads=req["threads"],
                         n_threads_batch=req["threads"], use_extra_bufts=False, verbose=False)

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        import numpy as np

        outs = []
        for prompt, n in zip(prompts, max_new_tokens):
            self.llm.reset()
            self.llm.eval(prompt)
            ids = []
            for _ in range(n):  # greedy: the argmax of the last position's logits, EOS ignored
                token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
                ids.append(token)
                if len(ids) < n:
                    self.llm.eval([token])
            outs.append(ids)
        return outs


PEERS = {"vllm": VLLMPeer, "llama.cpp": LlamaCppPeer}


def open_channel(fds: list[str]):
    """The pipe to and from the parent, from the last two arguments (its descriptors); None without them."""
    return (os.fdopen(int(fds[0]), "w"), os.fdopen(int(fds[1]))) if len(fds) == 2 else None


def ask_bandwidth(channel) -> float | None:
    """Bytes/s of a copy measured now by the parent, this process idle; None without a parent to ask."""
    if channel is None:
        return None
    to_parent, from_parent = channel
    to_parent.write("bandwidth\n")
    to_parent.flush()
    return float(from_parent.readline())


def timed_with_bandwidth(fn, measure_bandwidth):
    """(seconds, output, the mean of the copy bandwidths measured right before and right after the call): on a
    shared virtual machine the memory bandwidth moves by 2x within a minute, so a run's limit is its own."""
    before = measure_bandwidth()
    seconds, out = timed(fn)
    after = measure_bandwidth()
    return seconds, out, None if before is None else (before + after) / 2


def main(argv: list[str]) -> None:
    name, request_path, result_path = argv[:3]
    channel = open_channel(argv[3:])
    req = json.loads(open(request_path).read())
    startup, peer = timed(lambda: PEERS[name](req))
    result: dict = {"startup_s": startup}
    warm = req["warmup"]
    peer.generate(warm["prompts"], warm["max_new_tokens"])  # first calls pay for allocation and one-time setup
    if req.get("offline"):
        w = req["offline"]
        runs = []
        for _ in range(req["repeats"]):  # each run cold: no prompt in the prefix cache (where there is one)
            getattr(peer, "forget_prompts", lambda: None)()
            runs.append(timed(lambda: peer.generate(w["prompts"], w["max_new_tokens"])))
        result["offline"] = {"seconds": [t for t, _ in runs], "token_ids": runs[-1][1]}
    if req.get("batch1"):
        b = req["batch1"]
        prefill = min(timed(lambda: peer.generate([b["prompt"]], [1]))[0] for _ in range(req["repeats"]))
        runs = [timed_with_bandwidth(lambda: peer.generate([b["prompt"]], [1 + b["new_tokens"]]),
                                     lambda: ask_bandwidth(channel)) for _ in range(req["repeats"])]
        result["batch1"] = {"prefill_s": prefill, "decode_s": [t - prefill for t, _, _ in runs],
                            "copy_bandwidth": [bw for _, _, bw in runs], "token_ids": runs[-1][1][0]}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
