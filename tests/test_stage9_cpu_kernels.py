"""Stage 9's C++ elementwise kernels for CPU tensors (kernels/cpu.py, cpu_ops.cpp) against their torch versions
(kernels/native.py), on odd shapes and strided views; and which one "auto" picks.

float32: the same formulas, summed in another order (RMSNorm) or through other exp/cos/sin calls in the last bit.
bfloat16: rounded where torch rounds, so at most one bfloat16 step apart where a float32 difference crosses a
rounding boundary. The golden tests (stage 9 on CPU runs these kernels) check that tokens stay exact.
"""

from __future__ import annotations

import pytest
import torch

from stage9_moe import kernels
from stage9_moe.kernels import cpu, native

if cpu.unavailable_reason():
    pytest.skip(cpu.unavailable_reason(), allow_module_level=True)


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, fp32_tol: float = 2e-6) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = dict(atol=fp32_tol, rtol=fp32_tol) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 96), (300, 576), (3, 37)])
def test_cpu_rmsnorm_matches_torch(dtype, rows, dim):
    x, w = rand(rows, dim, dtype=dtype, scale=3), rand(dim, dtype=dtype, seed=1)
    close(cpu.rmsnorm(x, w, 1e-6), native.rmsnorm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (13, 200), (70, 576)])
def test_cpu_fused_add_rmsnorm_matches_torch(dtype, rows, dim):
    x, r, w = rand(rows, dim, dtype=dtype), rand(rows, dim, dtype=dtype, seed=2), rand(dim, dtype=dtype, seed=1)
    got, got_res = cpu.fused_add_rmsnorm(x, r, w, 1e-6)
    want, want_res = native.fused_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(got_res, want_res)  # one add of two same-dtype numbers: the same bits
    close(got, want, dtype)


def test_cpu_rmsnorm_of_a_strided_view():
    """Qwen3's q_norm reads q, a non-contiguous [N, H, D] view of the merged qkv."""
    qkv = rand(5, 3 * 4 * 32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    w = rand(32, seed=3)
    close(cpu.rmsnorm(q, w, 1e-6), native.rmsnorm(q, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 48), (33, 100), (3, 1536), (2, 7)])
def test_cpu_silu_and_mul_matches_torch(dtype, rows, d):
    x = rand(rows, 2 * d, dtype=dtype, scale=4)
    close(cpu.silu_and_mul(x), native.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 4, 2, 32), (13, 9, 3, 64), (40, 3, 3, 128), (5, 2, 1, 20)])
def test_cpu_rope_matches_torch(dtype, n, heads, kv_heads, head_dim):
    qkv = rand(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)  # strided views
    q, k = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(n))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    got_q, got_k = cpu.rotary_embedding(positions, q, k, inv_freq)
    want_q, want_k = native.rotary_embedding(positions, q, k, inv_freq)
    close(got_q, want_q, dtype, fp32_tol=1e-5)  # cos/sin of angles up to 4000 rad: a few ulps of the angle
    close(got_k, want_k, dtype, fp32_tol=1e-5)


def test_auto_picks_the_cpu_kernels_on_a_cpu_and_torch_can_be_forced():
    x, w = rand(3, 8), torch.ones(8)
    assert kernels.current_backend() == "auto" and kernels.use_cpu(x) and not kernels.use_triton(x)
    assert not kernels.use_cpu(x.double())  # dtypes the C++ does not take: torch
    with kernels.use_backend("torch"):
        assert not kernels.use_cpu(x)
        assert torch.equal(kernels.rmsnorm(x, w, 1e-6), native.rmsnorm(x, w, 1e-6))
    with kernels.use_backend("cpu"):
        assert kernels.use_cpu(x)
        assert torch.equal(kernels.rmsnorm(x, w, 1e-6), cpu.rmsnorm(x, w, 1e-6))


def test_cpu_kernels_refuse_bad_input():
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu.rmsnorm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="gate, then up"):
        cpu.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="residual must be"):
        cpu.fused_add_rmsnorm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="positions must be int64"):
        cpu.rotary_embedding(torch.zeros(2, dtype=torch.int32), torch.randn(2, 2, 8), torch.randn(2, 1, 8),
                             torch.ones(4))


# ---------------------------------------------------------------- gemv: the matmul of a decode step of one or two rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("out_features,in_features,bias", [(576, 576, False), (960, 576, True), (13, 100, True),
                                                           (3, 5, False), (70, 1536, False), (9, 40, True)])
def test_cpu_gemv_matches_float64_and_onednn(dtype, rows, out_features, in_features, bias):
    """Odd sizes reach every padding: rows of W past the last block of 8, K past the last 64 bytes; an odd number of
    blocks leaves a thread one block to read alone."""
    x, w = rand(rows, in_features, dtype=dtype), rand(out_features, in_features, dtype=dtype, seed=1)
    b = rand(out_features, dtype=dtype, seed=2) if bias else None
    got = cpu.gemv(x, cpu.block_for_gemv(w), b, out_features)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)  # [rows, out]
    assert got.dtype == dtype and got.shape == (rows, out_features)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    else:  # float32 sums rounded once to bfloat16: within one bfloat16 step of the exact value
        torch.testing.assert_close(got.double(), exact, atol=0.1, rtol=2 ** -8)
    onednn = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    close(got, onednn, dtype, fp32_tol=1e-4)


def test_block_for_gemv_interleaves_each_block_of_8_rows_one_64_byte_piece_at_a_time():
    w = torch.arange(10 * 20, dtype=torch.float32).view(10, 20)  # float32: 16 to a piece
    blocked = cpu.block_for_gemv(w)
    assert blocked.shape == (2, 2, 8, 16)  # [ceil(10 / 8), ceil(20 / 16), 8, 16]
    assert torch.equal(blocked[0, 0], w[:8, :16]) and torch.equal(blocked[0, 1, :, :4], w[:8, 16:])
    assert torch.equal(blocked[1, 1, :2, :4], w[8:, 16:])
    assert not blocked[0, 1, :, 4:].any() and not blocked[1, :, 2:].any()  # the padding is zeros
    assert cpu.block_for_gemv(w.bfloat16()).shape == (2, 1, 8, 32)  # bfloat16: 32 to a piece


def test_linear_reads_the_gemv_copy_for_one_or_two_rows():
    """pack_linear_weights keeps a copy of each weight in gemv's layout beside oneDNN's packed one; layers.linear
    sends one or two rows to gemv, more to oneDNN; with the torch kernels forced at packing time no copy is kept."""
    from torch import nn

    from stage9_moe import layers

    model = nn.Sequential(layers.ColumnParallelLinear(64, 40, bias=True), layers.RowParallelLinear(40, 64))
    for m in model:
        m.weight.data.copy_(rand(*m.weight.shape, seed=4))
    model[0].bias.data.copy_(rand(40, seed=5))
    plain = [m.weight.data.clone() for m in model]
    assert layers.pack_linear_weights(model) == 2
    for m, w in zip(model, plain):
        assert m.weight.is_mkldnn and torch.equal(m.gemv_weight, cpu.block_for_gemv(w))
    for rows in (0, 1, 2, 3, 8):  # no rows (an empty batch) is oneDNN's too
        x = rand(rows, 64, seed=rows)
        want = cpu.gemv(x, model[0].gemv_weight, model[0].bias, 40) if 1 <= rows <= cpu.GEMV_MAX_ROWS else \
            torch.ops.mkldnn._linear_pointwise(x, model[0].weight, model[0].bias, "none", [], "")
        assert torch.equal(model[0](x), want)
    compiled = torch.compile(model[1], dynamic=False, fullgraph=True)  # gemv inside a compiled graph
    x = rand(1, 40, seed=9)
    assert torch.equal(compiled(x), cpu.gemv(x, model[1].gemv_weight, None, 64))
    forced = layers.ReplicatedLinear(16, 8)
    with kernels.use_backend("torch"):
        layers.pack_linear_weights(nn.Sequential(forced))
    assert forced.weight.is_mkldnn and forced.gemv_weight is None


def test_gemv_refuses_bad_input():
    w = cpu.block_for_gemv(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="gemv takes 1 to 2 rows, got 3"):
        cpu.gemv(torch.randn(3, 8), w, None, 4)
    with pytest.raises(RuntimeError, match=r"weight must be a \[4, 8\] matrix of x's dtype blocked by block_for_gemv"):
        cpu.gemv(torch.randn(1, 8), torch.randn(4, 8), None, 4)  # a plain matrix
    with pytest.raises(RuntimeError, match=r"weight must be a \[9, 8\] matrix"):
        cpu.gemv(torch.randn(1, 8), w, None, 9)  # 9 rows need two blocks
    with pytest.raises(RuntimeError, match=r"weight must be a \[4, 8\] matrix of x's dtype"):
        cpu.gemv(torch.randn(1, 8), cpu.block_for_gemv(torch.randn(4, 8, dtype=torch.bfloat16)), None, 4)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu.gemv(torch.randn(1, 8), w, torch.randn(5), 4)


def test_golden_smollm2_one_prompt_at_a_time_through_gemv():
    """Every decode step of one request runs its matmuls through gemv, eagerly and in the compiled decode (with the
    cpu attention backend, whose operators the compiled graph calls itself, as the peer benchmark runs it): float32
    gives the reference's tokens."""
    import stage9_moe
    from common.golden import failures, load_golden
    from common.models import resolve_model
    from stage9_moe.attention import available_backends

    has_cpu_attention = "cpu" in available_backends("cpu")
    golden = load_golden("smollm2-135m-instruct")
    params = stage9_moe.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0)
    for compiled in (False, True):
        llm = stage9_moe.LLM(str(resolve_model("smollm2-135m-instruct")), dtype="float32", verbose=False,
                             enable_torch_compile=compiled, torch_compile_max_bs=1, max_running_requests=1,
                             attention_backend="cpu" if compiled and has_cpu_attention else "torch")
        assert llm.engine.model.lm_head.gemv_weight is not None or \
            llm.engine.model.model.embed_tokens.gemv_weight is not None
        results = [llm.generate([case["prompt"]], params)[0] for case in golden["cases"]]
        problems = failures(results, golden)
        assert not problems, f"gemv, compiled={compiled}:\n" + "\n".join(problems)
        if compiled:
            assert llm.engine.num_graph_replays == sum(len(r.token_ids) - 1 for r in results)
        llm.close()
