"""Stage 5 on a CPU moves the model's weights into 2 MB pages (engine.weights_into_huge_pages), so that a decode
step streaming every weight does not walk the page table every 4 KB. What must hold here: the weights end up in 2 MB
pages where the kernel can do it, and their products are unchanged; that the engine still gives the golden tokens is
tests/test_golden.py's check, run on every stage."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from common.bench_weight_pages import huge_fraction
from stage5_cudagraph.engine import weights_into_huge_pages
from stage5_cudagraph.kv_cache import advise_huge_pages
from stage5_cudagraph.layers import pack_weight


def kernel_collapses() -> str | None:
    """Why this machine cannot collapse memory into 2 MB pages, or None."""
    if sys.platform != "linux":
        return "not Linux"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are turned off"
    except OSError:
        return "no transparent huge pages"
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return None if (major, minor) >= (6, 1) else "MADV_COLLAPSE needs Linux 6.1"


CANNOT_COLLAPSE = kernel_collapses()


@pytest.mark.skipif(CANNOT_COLLAPSE is not None, reason=str(CANNOT_COLLAPSE))
def test_packed_weights_move_into_huge_pages_with_their_values_intact():
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, 576, generator=gen) for n in (960, 576, 3072) * 4]  # ~32 MB, many 2 MB pages
    weights = torch.nn.ParameterList(pack_weight(w) for w in plain)
    x = torch.randn(8, 576, generator=gen)
    before = [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in weights]
    weights_into_huge_pages(weights)
    # smaps counts 2 MB pages per mapping, not per tensor: the share is an estimate
    assert huge_fraction(list(weights)) > 0.5
    after = [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in weights]
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_advise_rounds_inward_and_ignores_spans_without_a_whole_huge_page(monkeypatch):
    calls = []

    class FakeLibc:
        def madvise(self, start, length, advice):
            calls.append((start.value, length.value, advice))
            return 0

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr("ctypes.CDLL", lambda _: FakeLibc())
    mb2 = 1 << 21
    advise_huge_pages(mb2 + 10, 4 * mb2 + 5, collapse=True)  # the whole pages inside: [4 MB, 8 MB)
    advise_huge_pages(5 * mb2 + 1, 6 * mb2 + 100)  # no whole 2 MB page inside: nothing
    assert calls == [(2 * mb2, 2 * mb2, 14), (2 * mb2, 2 * mb2, 25)]
