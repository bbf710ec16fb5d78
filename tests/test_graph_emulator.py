"""The CPU graph emulator (common/graph_emulator.py) behaves like a CUDA graph where the stage 5 tests rely on it:
replay recomputes from the current contents of the captured inputs into the captured outputs, and what a real
capture refuses (host syncs, tensors from host data) raises."""

from __future__ import annotations

import pytest
import torch

from common import graph_emulator as cuda


def capture(fn):
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        out = fn()
    return g, out


def test_replay_reads_new_inputs_into_the_same_output():
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    g, out = capture(lambda: torch.relu(x @ w).to(torch.float64).sum(-1))  # `to` makes a new tensor here
    address = out.data_ptr()
    x.copy_(torch.randn(3, 4))
    g.replay()
    assert out.data_ptr() == address and g.num_replays == 1
    torch.testing.assert_close(out, torch.relu(x @ w).to(torch.float64).sum(-1))


def test_in_place_writes_and_views_are_replayed():
    cache, idx, val = torch.zeros(8), torch.tensor([1]), torch.ones(1)
    g, _ = capture(lambda: cache.index_put_((idx,), val * 2))
    cache.zero_()
    idx.fill_(5)
    val.fill_(3.0)
    g.replay()
    assert cache.tolist() == [0, 0, 0, 0, 0, 6, 0, 0]


def test_python_values_are_frozen_at_capture():
    x = torch.arange(10.0)
    n = 4  # e.g. a length the host read from the data before capture
    g, out = capture(lambda: x[:n].sum())
    x.fill_(1.0)
    g.replay()
    assert out.item() == 4.0  # the first n elements, as captured: n = 4 whatever the host thinks now


@pytest.mark.parametrize("bad", [
    lambda x: x.sum().item(),  # .item(): the host waits for the device
    lambda x: x[x > 0],  # boolean mask: output shape depends on the data (nonzero)
    lambda x: x + torch.tensor([1.0, 2.0, 3.0]),  # a copy from pageable host memory
    lambda x: bool(x.sum() > 0),  # `if tensor:`
])
def test_what_a_capture_refuses_raises(bad):
    x = torch.randn(3)
    with pytest.raises(cuda.GraphCaptureError):
        capture(lambda: bad(x))
    capture(lambda: x * 2)  # the emulator is usable again afterwards


def test_replay_refuses_a_shape_that_changed():
    x = torch.randn(4)
    sizes = [2]
    g, _ = capture(lambda: x.new_zeros(sizes[0]))
    g.ops[0][2][1][0] = 3  # as if a recorded size argument now held another value
    with pytest.raises(cuda.GraphCaptureError, match="shape"):
        g.replay()
