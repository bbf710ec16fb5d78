"""Stage 5, part 5.8: the kernels a captured decode step launches, counted on a CPU.

The graph emulator (common/graph_emulator.py) records every op of a capture as a CUDA graph records kernels;
`CUDAGraph.kernel_launches()` counts those that would run on a GPU (views and bare allocations launch nothing).
One layer's share is the difference between the model's graph and the same model's graph with one layer less.
With the torch versions of the norms, RoPE and SwiGLU (what a CPU runs) a Qwen3 layer launches ~61 kernels in
bfloat16; with the Triton kernels (what CUDA runs: here in Triton's interpreter) 12. The fused kernels equal their
torch versions, and golden tokens hold with them inside emulated graphs.
"""

from __future__ import annotations

import collections

import pytest
import torch

import stage5_cudagraph.graph as graph_module
from common import graph_emulator
from common.models import resolve_model
from stage5_cudagraph import LLM, SamplingParams, kernels
from stage5_cudagraph.graph import GraphRunner
from stage5_cudagraph.kernels import native

pytest.importorskip("triton", reason="triton is not installed (Linux only): our Triton kernels cannot run")

# One decoder layer of the captured decode step, with the Triton kernels: 4 matmuls (qkv, o, gate_up, down), the
# two norms with the residual add fused in, q/k norm + RoPE in one kernel (Qwen3; RoPE alone otherwise), SiLU-and-
# mul, the K and V stores, and the triton attention backend's split decode kernel and its combine.
FUSED_LAYER = {"mkldnn._linear_pointwise.default": 4, "_rmsnorm_kernel": 2, "_rope_kernel": 1,
               "_silu_and_mul_kernel": 1, "index_put_.default": 2, "_decode_partial_kernel": 1,
               "_decode_combine_kernel": 1}


def per_layer(engine, max_bs: int) -> dict[int, collections.Counter]:
    """bucket -> the kernels one layer adds to its captured step (graph of L layers minus graph of L - 1)."""
    layers = engine.model.model.layers
    full = {bs: g.kernel_launches() for bs, g in engine.graph_runner.graphs.items()}
    engine.model.model.layers = layers[:-1]
    try:
        fewer = GraphRunner(engine, max_bs)
    finally:
        engine.model.model.layers = layers
    return {bs: full[bs] - fewer.graphs[bs].kernel_launches() for bs in full}


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(graph_module, "cuda", graph_emulator)


# The torch versions, one layer, bfloat16: each RMSNorm 8 kernels (2 casts, pow, mean, add, rsqrt, 2 mul), RoPE 11
# (cos/sin tables, two rotate_half: neg + cat each, four products, two adds), SwiGLU 2, two residual adds.
TORCH_LAYER_TOTAL = {"tiny-qwen3": 61, "tiny-llama": 45}


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_kernels_per_layer_of_the_captured_step(model, emulated):
    path = str(resolve_model(model))
    backends = ("torch", "triton") if model == "tiny-qwen3" else ("triton",)
    counts = {}
    for backend in backends:
        with kernels.use_backend(backend):
            llm = LLM(path, dtype="bfloat16", attention_backend="triton", cuda_graph_max_bs=2,
                      max_total_tokens=256, disable_overlap=True, verbose=False)
            counts[backend] = per_layer(llm.engine, 2)
    for bs in (1, 2):  # the same in every bucket: one launch covers the whole batch
        assert counts["triton"][bs] == collections.Counter(FUSED_LAYER)
        if "torch" in counts:
            assert sum(counts["torch"][bs].values()) == TORCH_LAYER_TOTAL[model]


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 4, 2, 32), (7, 3, 1, 48)])
def test_qk_norm_rope_matches_torch(dtype, n, heads, kv_heads, head_dim):
    """The fused Qwen3 kernel reads q and k as the strided views of the merged qkv they are."""
    from stage5_cudagraph.kernels import triton_rope

    qkv = rand(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=3)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    qw, kw = rand(head_dim, dtype=dtype, seed=1), rand(head_dim, dtype=dtype, seed=2)
    positions = torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(3))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    got = triton_rope.rotary_embedding(positions, q, k, inv_freq, (qw, kw, 1e-6))
    want = native.qk_norm_rope(positions, q, k, qw, kw, 1e-6, inv_freq)
    # float32: summation order only; bf16: the kernel rounds the rotation once, torch after each op
    tol = dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), **tol)
    with kernels.use_backend("triton"):  # what the model calls
        routed = kernels.qk_norm_rope(positions, q, k, qw, kw, 1e-6, inv_freq)
    assert all(torch.equal(a, b) for a, b in zip(routed, got))


def test_golden_with_fused_kernels_in_emulated_graphs(emulated):
    """Float32 greedy tokens equal transformers' (the golden file's first 12 of each case) with every fused kernel
    (Triton's interpreter) in the prefill and in the captured decode steps, a padded bucket included (3 requests
    run in the bucket of 4)."""
    from common.golden import TIE_MARGIN, compare, load_golden

    golden = load_golden("tiny-qwen3")
    cases, n = golden["cases"][:3], 12  # the interpreter is slow: a prefix of three cases is enough here
    with kernels.use_backend("triton"):
        llm = LLM(str(resolve_model("tiny-qwen3")), attention_backend="torch", cuda_graph_max_bs=4,
                  max_total_tokens=1024, disable_overlap=True, verbose=False)
        results = llm.generate([c["prompt"] for c in cases], SamplingParams(max_new_tokens=n))
    for case, result in zip(cases, results, strict=True):
        cmp = compare(list(result.token_ids), case["output_ids"][:n], case["margins"][:n],
                      golden.get("tie_margin", TIE_MARGIN))
        assert cmp.ok, f"{case['name']}: {cmp.message}"
    engine, runner = llm.engine, llm.engine.graph_runner
    assert engine.num_graph_replays >= n - 1 and runner.graphs[4].num_replays > 0
    launched = {op[1].fn.__name__ for g in runner.graphs.values() for op in g.ops if op[0] == "triton"}
    assert launched == {"_rmsnorm_kernel", "_rope_kernel", "_silu_and_mul_kernel"}
