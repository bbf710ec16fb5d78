"""A CPU stand-in for the slice of `torch.cuda` that a CUDA-graph runner uses, so graph code runs in CPU tests.

A CUDA graph records kernels with their pointer arguments and replays them: the same kernels on the same addresses
with the same shapes, whatever the host would compute differently today. This emulator does the same one level up.
While "capturing" it records every aten op (and every Triton kernel launch) together with the tensor objects it
read and wrote; `replay()` runs that list again on the same tensors, writing each op's result into the tensor the
capture produced (a fixed address, as in a real graph). So a forward that is not graph-safe fails here as on a GPU:

- host syncs (`.item()`, `int(t)`, `if t:`, `nonzero`, boolean-mask indexing) raise during capture, as CUDA's
  "operation not permitted when stream is capturing" does;
- tensors made from host data during capture (`torch.tensor([...])`, an H2D copy from pageable memory) raise;
- a shape or Python number computed from the data at capture time stays frozen at replay, exactly as it would in a
  CUDA graph: the replayed result is then wrong (or an op's output changes shape, which raises here).

What it does not check: streams and their ordering, memory-pool sizes, timing, and device placement (on a CPU every
tensor is a "device" tensor, so a host-to-device copy inside the capture goes unnoticed unless it is
`torch.tensor(...)`). A real capture also records without running; the emulator runs the block once, like the warm-up
before a capture. It is test support: engine code never imports it; tests swap it in for the module-level `cuda`
name of a stage's graph.py:

    monkeypatch.setattr(stage5_cudagraph.graph, "cuda", graph_emulator)   # in a test
    with graph_emulator.emulating(stage5_cudagraph.graph): ...            # anywhere else
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

EMULATED = True  # graph.py's `can_capture` accepts any device when the API it holds is this one

aten = torch.ops.aten
HOST_SYNC = {  # ops whose result the host must wait for, or whose output shape depends on the data
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.bincount.default,
}
HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}  # torch.tensor(data): a copy from host memory
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
               aten.new_empty_strided.default, aten.empty_like.default}  # memory only: no kernel runs
CASTS = {aten.to.dtype, aten._to_copy.default}


class GraphCaptureError(RuntimeError):
    pass


_capturing = threading.local()  # the graph being recorded on this thread, if any


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "CUDAGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC:
            raise GraphCaptureError(f"{func} needs the data on the host: not allowed while capturing a graph")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            raise GraphCaptureError(f"{func} with a boolean mask: its output shape depends on the data (nonzero)")
        if func in HOST_DATA:
            raise GraphCaptureError(f"{func}: a tensor built from host data (torch.tensor) inside a captured region")
        out = func(*args, **kwargs)
        # Replay writes each new output back into the tensor captured here. Outputs in an input's storage (views,
        # in-place results) need no write-back: the op itself writes the captured memory.
        # (a weight packed into oneDNN's layout is an opaque tensor without a storage: never an output)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not t.is_mkldnn}
        fresh = [(i, t) for i, t in enumerate(tree_flatten(out)[0])
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        self.graph.ops.append(("aten", func, args, kwargs, fresh))
        return out


def _record_triton_launches() -> None:
    """Triton kernels run outside torch's dispatcher: record each launch as one op (interpreter mode only)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    if getattr(InterpretedFunction.run, "_emulator_hook", False):
        return
    run = InterpretedFunction.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        graph = getattr(_capturing, "graph", None)
        if graph is None or warmup:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        graph.ops.append(("triton", self, args, dict(kwargs, grid=grid, warmup=warmup), None))
        with _disable_current_modes():  # the interpreter's own copies are part of the launch, not recorded ops
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recorded_run._emulator_hook = True
    InterpretedFunction.run = recorded_run


class CUDAGraph:
    def __init__(self):
        self.ops: list[tuple] = []
        self.num_replays = 0

    def replay(self) -> None:
        with torch.inference_mode():  # writes into tensors captured under inference mode (no autograd on a GPU graph)
            self._replay()
        self.num_replays += 1

    def _replay(self) -> None:
        for kind, func, args, kwargs, fresh in self.ops:
            if kind == "triton":  # func is the kernel: launch it again with the recorded arguments and grid
                type(func).run(func, *args, **kwargs)
                continue
            results = tree_flatten(func(*args, **kwargs))[0]
            for i, orig in fresh:
                new = results[i]
                if orig.shape != new.shape:
                    raise GraphCaptureError(f"{func} produced shape {tuple(new.shape)} at replay but "
                                            f"{tuple(orig.shape)} at capture: its shape depends on the data")
                orig.copy_(new)

    def pool(self):
        return ("emulated-pool", id(self))

    def kernel_launches(self) -> collections.Counter:
        """What a replay of this graph would launch on a GPU, by name -> count: every recorded Triton kernel, and every
        aten op that writes memory (a new output, or an in-place write). Views, and allocations alone (`empty`: no
        kernel, a pointer into the graph's pool), launch nothing. A matmul counts one (cuBLAS may split one into two).
        Under Triton's interpreter a kernel writes float32 and torch rounds the result to the model's dtype afterwards
        (kernels/triton_utils.py): those casts, right after a launch, are not counted, as a GPU does not run them."""
        counts: collections.Counter = collections.Counter()
        after_triton = False
        for kind, func, args, kwargs, fresh in self.ops:
            if kind == "triton":
                counts[func.fn.__name__] += 1
                after_triton = True
                continue
            if after_triton and func in CASTS and args[0].dtype == torch.float32:
                continue  # the interpreter's rounding of the kernel's float32 output
            after_triton = False
            if func not in ALLOCATIONS and (fresh or func._schema.is_mutable):
                counts[func.__name__ if func.namespace == "aten" else str(func)] += 1
        return counts


@contextlib.contextmanager
def graph(cuda_graph: CUDAGraph, pool=None, stream=None):
    """Record the ops of the block into `cuda_graph` (they also run once, so the block's outputs exist)."""
    if getattr(_capturing, "graph", None) is not None:
        raise GraphCaptureError("nested graph capture")
    _record_triton_launches()
    _capturing.graph = cuda_graph
    try:
        with _Recorder(cuda_graph):
            yield cuda_graph
    finally:
        _capturing.graph = None


class Stream:
    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def stream(s):
    yield s


def current_stream(device=None) -> Stream:
    return Stream(device)


def synchronize(device=None) -> None:
    pass


@contextlib.contextmanager
def emulating(graph_module):
    """Within the block, `graph_module` (a stage's graph.py) captures and replays through this emulator."""
    previous, graph_module.cuda = graph_module.cuda, sys.modules[__name__]
    try:
        yield
    finally:
        graph_module.cuda = previous
