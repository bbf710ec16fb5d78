"""The CUDA-graph runner: record a decode step once per batch-size bucket, then replay it with one
launch.

Why: a decode step of a small model is hundreds of tiny kernels (per layer: norms, 4 matmuls, RoPE,
the KV store, attention, the MLP). Each launch costs the CPU a few microseconds, so at batch 1 the
GPU finishes each kernel before the CPU has launched the next: the step is bound by Python + launch
overhead, not by the GPU. A CUDA graph records the whole sequence of kernels once (with their
pointer arguments) and `replay()` launches all of it in one call.

The price: a graph replays *exactly* what was recorded, so
- every tensor it reads or writes must live at a fixed address: static buffers, filled with `copy_`
  before replay;
- every shape is fixed: one graph per batch size. Real batches are padded up to the next bucket (1,
  2, 4, 8, then steps of 8) and the padded rows' logits are dropped;
- nothing may depend on host-side values of the data: no `.item()`, no shapes computed from
  `seq_lens` on the host. The triton and flash_attn backends read `seq_lens` on the device already.
  The torch backend's varlen layout is sized on the host every step, so the captured ForwardBatch
  carries none (no `init_forward_metadata`) and the backend falls back to its padded gather of
  `max_seq_len` keys: we give it the largest context the page table can describe (correct, slower);
- padded rows still run: each writes its K/V to a reserved dummy slot (a page no request ever owns),
  with seq_len 1, page-table row 0 (only read, and the result is dropped), token 0 at position 0.

All graphs share one memory pool (`pool=`): they never run at the same time, so the big bucket's
intermediate buffers are reused by the smaller ones (captured largest first, as SGLang does).
"""

from __future__ import annotations

import time

import torch

from .attention import ForwardBatch

# The CUDA API this file uses. CPU tests swap in common/graph_emulator.py, which records and replays
# ops the way a graph does, so the buffers, padding and replay below run (and are checked for graph
# safety) without a GPU.
cuda = torch.cuda


def can_capture(device: torch.device) -> bool:
    return device.type == "cuda" or getattr(cuda, "EMULATED", False)


def bucket_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_bs (max_bs itself always included)."""
    if max_bs < 1:
        raise ValueError(f"the largest CUDA-graph batch size must be >= 1, got {max_bs}")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    return sizes if sizes[-1] == max_bs else sizes + [max_bs]


def pick_bucket(buckets: list[int], batch_size: int) -> int:
    """The smallest bucket that holds the batch."""
    for b in buckets:
        if b >= batch_size:
            return b
    raise ValueError(f"batch of {batch_size} exceeds the largest bucket {buckets[-1]}")


class GraphRunner:
    def __init__(self, engine, max_bs: int):
        self.engine, self.buckets = engine, bucket_sizes(max_bs)
        self.max_bs, dev = self.buckets[-1], engine.device
        # a KV slot of the reserved page: padded rows write here
        self.dummy_slot = engine.dummy_slot
        # Static inputs, [max_bs] each; a bucket of size bs uses the first bs entries (views keep
        # the address).
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.out_cache_loc = torch.full((self.max_bs, ), self.dummy_slot, dtype=torch.long,
                                        device=dev)
        self.req_rows = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)  # decode: unused
        # one token per row
        self.cu_seqlens = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.last_token_indices = torch.arange(self.max_bs, dtype=torch.long, device=dev)
        # The torch backend gathers max_seq_len keys: capture with the most the page table can hold.
        self.max_seq_len = engine.page_table.table.shape[1] * engine.kv_pool.page_size
        self.graphs: dict[int, cuda.CUDAGraph] = {}
        # bs -> static logits [bs, vocab] the graph writes
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture()

    def forward_batch(self, bs: int) -> ForwardBatch:
        """The static ForwardBatch of bucket bs: views of the buffers above, the engine's pool and
        page table, and no attention metadata (it would freeze one step's layout into the graph)."""
        e = self.engine
        return ForwardBatch(
            phase="decode", input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_rows=self.req_rows[:bs],
            prefix_lens=self.prefix_lens[:bs], seq_lens=self.seq_lens[:bs],
            cu_seqlens=self.cu_seqlens[:bs + 1], max_seqlen=1, max_seq_len=self.max_seq_len,
            prefix_lens_cpu=[], seq_lens_cpu=[], last_token_indices=self.last_token_indices[:bs],
            kv_pool=e.kv_pool, page_table=e.page_table.table, attn_backend=e.attn_backend)

    def _run_model(self, bs: int) -> torch.Tensor:
        # [bs, vocab]
        return self.engine.model(self.input_ids[:bs], self.positions[:bs], self.forward_batch(bs))

    def capture(self) -> None:
        # Warm up outside capture on a side stream: cuBLAS handles, Triton compilation and
        # autotuning must not happen while recording (torch's documented recipe). The buffers hold
        # padding: writes go to the dummy slot.
        side = cuda.Stream(self.engine.device)
        side.wait_stream(cuda.current_stream(self.engine.device))
        with cuda.stream(side):
            for bs in self.buckets:
                self._run_model(bs)
        cuda.current_stream(self.engine.device).wait_stream(side)
        cuda.synchronize(self.engine.device)
        for bs in reversed(self.buckets):  # largest first: the smaller graphs fit in its memory
            graph = cuda.CUDAGraph()
            with cuda.graph(graph, pool=self.pool):
                out = self._run_model(bs)  # recorded, not run
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.phase == "decode" and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Copy a real decode batch into the static buffers, pad to the bucket, replay -> logits [B,
        vocab]."""
        B = fb.batch_size
        bs = self.load_inputs(fb)
        self.graphs[bs].replay()
        # A view of the static output: valid until the next replay, which the caller's stream orders
        # after its use.
        return self.outputs[bs][:B]

    def load_inputs(self, fb: ForwardBatch) -> int:
        """Copy the batch into the static buffers and pad it: -> the bucket it runs in."""
        B = fb.batch_size
        bs = pick_bucket(self.buckets, B)
        self.input_ids[:B].copy_(fb.input_ids)  # device-to-device copies: no host sync
        self.positions[:B].copy_(fb.positions)
        self.out_cache_loc[:B].copy_(fb.out_cache_loc)
        self.req_rows[:B].copy_(fb.req_rows)
        self.seq_lens[:B].copy_(fb.seq_lens)
        if bs > B:  # padded rows: token 0 at position 0, row 0, one key, K/V into the dummy slot
            self.input_ids[B:bs].zero_()
            self.positions[B:bs].zero_()
            self.out_cache_loc[B:bs].fill_(self.dummy_slot)
            self.req_rows[B:bs].zero_()
            self.seq_lens[B:bs].fill_(1)
        return bs


# ---------------------------------------------------------------- a CPU: the same runner, compiled
# A CPU has no graphs to replay, but the cost they remove is there too: a decode step of a small
# model is hundreds of operators, each paying Python and torch's dispatch, small next to the matmuls
# only when the batch is large. torch.compile (inductor's CPU backend) turns the decode forward of
# one bucket into generated C++ loops (norms, RoPE, SwiGLU and residual adds fused) around the
# matmul kernels, with the shapes fixed (dynamic=False): one compiled graph per bucket, the same
# buckets, static buffers and padding as above. What it cannot take in is the torch backend's
# attention, whose layout is decided on the host each step: it stays one opaque operator per layer
# (vLLM and SGLang keep attention out of their compiled graphs the same way), which reads the step's
# real batch. Stage 4's cpu backend decides nothing on the host (its kernels read seq_lens and the
# page table from tensors), so its attention goes into the graph as it goes into a CUDA graph: the
# KV store and the decode kernel become two operator calls of the generated code, padded rows and
# all, with no Python between the layers.
IN_GRAPH_BACKENDS = ("cpu",)
_PACKAGE = __name__.split(".")[0]  # each stage package registers its own operator
_step_batch: list[ForwardBatch | None] = [None]  # the real ForwardBatch of the step being replayed


def _step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layer_id: int) -> torch.Tensor:
    """q [bs, H, D], k/v [bs, KVH, D] of a padded bucket -> [bs, H, D]: the real rows stored and
    attended by the engine's backend, with the metadata it built for this step; the padded rows'
    outputs are zeros."""
    fb = _step_batch[0]
    B = fb.batch_size
    out = fb.attn_backend.forward(q[:B], k[:B], v[:B], layer_id, fb)  # [B, H, D]
    return out if B == q.shape[0] else torch.cat([out, out.new_zeros(q.shape[0] - B, *q.shape[1:])])


# Defined with torch.library.Library, as layers.onednn_linear is: ~5 us a call less than the
# @custom_op decorator's wrapper, once per layer of every step.
_LIB = torch.library.Library(_PACKAGE, "FRAGMENT")
_LIB.define("step_attention(Tensor q, Tensor k, Tensor v, int layer_id) -> Tensor")
_LIB.impl("step_attention", _step_attention, "CompositeExplicitAutograd")
torch.library.register_fake(f"{_PACKAGE}::step_attention", lib=_LIB)(
    lambda q, k, v, layer_id: torch.empty_like(q))
step_attention = getattr(torch.ops, _PACKAGE).step_attention


class StepAttention:
    """The attention backend a compiled graph sees: one operator per layer that torch.compile does
    not enter."""

    name = "step_attention"

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        return step_attention(q, k, v, layer_id)


def step_inputs_only(guards) -> list[bool]:
    """Dynamo's guard filter for the compiled decode: keep the guards on the step's input tensors
    (their shapes pick the bucket) and on the global modes (grad mode and the like, unnamed);
    drop those on the model and the static ForwardBatch, which a replay never changes."""
    return [g.name in ("input_ids", "positions") or g.name == "" for g in guards]


class CompiledRunner(GraphRunner):
    """GraphRunner's buckets, buffers and padding; "capture" compiles the decode forward for each
    bucket, "replay" calls that compiled code. `compile_seconds[bs]`: what each bucket's compile
    cost.

    Dynamo guards the compiled code with only the inputs that tell the buckets apart (their
    batch size) and the global modes (`guard_filter_fn`, `step_inputs_only`): by default it would
    also check ~6,800 guards on the model's modules and parameters and on the static batch before
    every step (~0.5 ms at batch 1, even cut to the buckets' differences at replay). It is safe
    for the reason a CUDA graph replay is: the model and the static buffers are the same every
    time. For the same reason the generated code does not check each input's sizes and strides on
    every call (`size_asserts`: ~220 checks a step at batch 1, ~0.2 ms). And it calls its kernels
    and operators from C++ (`cpp_wrapper`), not from the Python module inductor writes by default,
    one Python call each (~300 a step): compiling takes longer (the wrapper is C++ too: ~40 s a
    bucket for SmolLM2, once: inductor keeps it in its on-disk cache), and a step takes less time
    (README, "On a CPU")."""

    def capture(self) -> None:
        import torch._dynamo

        # one compiled graph per bucket, all kept (dynamo's default keeps 8 per function)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    len(self.buckets) + 1)
        model = self.engine.model
        # without its inference_mode: compiled code runs under no_grad
        forward = type(model).forward.__wrapped__

        def decode_forward(input_ids, positions, fb):
            return forward(model, input_ids, positions, fb)  # [bs, vocab]

        # Dynamo keeps compiled code on the function's code object, which every runner's
        # decode_forward shares: with the model's guards filtered out, a second engine in this
        # process (another dtype, say) would run the first one's code. A copy of the code object
        # gives each runner a cache of its own.
        decode_forward.__code__ = decode_forward.__code__.replace()

        self.compiled = torch.compile(decode_forward, dynamic=False, fullgraph=True,
                                      options={"size_asserts": False, "cpp_wrapper": True,
                                               "guard_filter_fn": step_inputs_only})
        self.static_batches = {bs: self.forward_batch(bs) for bs in self.buckets}
        if self.engine.attn_backend.name not in IN_GRAPH_BACKENDS:
            for fb in self.static_batches.values():
                fb.attn_backend = StepAttention()
        self.compile_seconds: dict[int, float] = {}
        for bs in reversed(self.buckets):
            self.load_inputs(self.padding_batch(bs))
            start = time.perf_counter()
            self.launch(self.padding_batch(bs), bs)  # the first call compiles
            self.compile_seconds[bs] = time.perf_counter() - start

    def padding_batch(self, bs: int) -> ForwardBatch:
        """A real batch of bs padding rows (the dummy slot, page-table row 0, one key), for the
        compiling calls."""
        e = self.engine
        fb = self.forward_batch(bs)
        fb.input_ids, fb.positions = fb.input_ids.clone(), fb.positions.clone()
        fb.max_seq_len, fb.prefix_lens_cpu, fb.seq_lens_cpu = 1, [0] * bs, [1] * bs
        fb.out_cache_loc = torch.full((bs,), self.dummy_slot, dtype=torch.long, device=e.device)
        fb.req_rows, fb.seq_lens = torch.zeros_like(fb.req_rows), torch.ones_like(fb.seq_lens)
        e.attn_backend.init_forward_metadata(fb)
        return fb

    def launch(self, fb: ForwardBatch, bs: int) -> torch.Tensor:
        _step_batch[0] = fb
        try:
            with torch.no_grad():
                return self.compiled(self.input_ids[:bs], self.positions[:bs],
                                     self.static_batches[bs])
        finally:
            _step_batch[0] = None

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = self.load_inputs(fb)
        return self.launch(fb, bs)[: fb.batch_size]  # [B, vocab]
