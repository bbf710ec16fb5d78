"""Stage 2's attention backends: the torch reference against a naive formula, our triton kernels against torch
(on a CPU through Triton's interpreter), flash_attn against torch on a GPU, and create_backend's choices and errors.

The interpreter is slow (each kernel program is a Python loop over NumPy tiles): CPU cases stay small.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Triton picks interpreter-or-compiler when `@triton.jit` runs: for its own helpers (tl.sum, tl.max) when triton is
# first imported, for our kernels when triton_kernels is. So set it before importing either. (triton_kernels sets the
# same default itself, and tests/conftest.py sets it for the whole run; this line covers running the file alone. If
# something imported triton earlier in this process without it, the in-process triton tests skip with that reason.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stage2_batch.attention import BACKENDS, available_backends, create_backend, default_backend  # noqa: E402
from stage2_batch.attention.torch_backend import TorchBackend  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
LENS = [1, 7, 33, 64, 100]  # odd lengths, a single token, a block-sized one


@pytest.fixture(scope="module")
def tb():
    """The triton_backend module, or a clean skip."""
    pytest.importorskip("triton")
    from stage2_batch.attention import triton_backend

    if not HAS_CUDA and not triton_backend.INTERPRET:
        pytest.skip("no CUDA and TRITON_INTERPRET was not 1 when triton_backend was imported")
    if triton_backend.INTERPRETER_BROKEN:  # see triton_kernels.py; the fresh-process test below still runs
        pytest.skip("another module imported triton before TRITON_INTERPRET=1 was set in this process")
    return triton_backend


def packed_prompts(lens, H, KVH, D, dtype=torch.float32, device="cpu", views=False, seed=0):
    """q: [N, H, D], k, v: [N, KVH, D], cu_seqlens: [B+1] int32. views=True: q, k, v are column slices of one
    [N, (H + 2 KVH) * D] tensor, as a fused qkv projection produces them (non-contiguous, row stride != H*D)."""
    g = torch.Generator().manual_seed(seed)
    N = sum(lens)
    qkv = torch.randn(N, (H + 2 * KVH) * D, generator=g).to(dtype=dtype, device=device)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
    q, k, v = q.view(N, H, D), k.view(N, KVH, D), v.view(N, KVH, D)
    if not views:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu, max(lens)


def cache_batch(seq_lens, slot_ids, H, KVH, D, max_len, num_slots, layers=3, layer=1, dtype=torch.float32,
                device="cpu", slot_major=False, seed=0):
    """q: [B, H, D]; k_cache, v_cache: [num_slots, max_len, KVH, D] views of layer `layer` of a bigger cache, as the
    engine hands them to a backend; slot_ids, seq_lens: [B] int32.
    The engine's [layers, num_slots, max_len, KVH, D] cache gives a contiguous view that starts mid-storage (storage
    offset != 0); slot_major=True allocates [num_slots, layers, ...] instead, so the view is truly strided."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_slots, layers, max_len, KVH, D) if slot_major else (layers, num_slots, max_len, KVH, D)
    k_all = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    v_all = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    if slot_major:
        k_all, v_all = k_all.transpose(0, 1), v_all.transpose(0, 1)
    q = torch.randn(len(seq_lens), H, D, generator=g).to(dtype=dtype, device=device)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return q, k_all[layer], v_all[layer], as_i32(slot_ids), as_i32(seq_lens)


def naive_attention(q, k, v, scale):
    """softmax(q k^T * scale) v for ONE request, head by head, in float64, causal with queries at the end.
    q: [T, H, D]; k, v: [S, KVH, D] with S >= T. Query i sits at position S - T + i and sees keys 0 .. S - T + i."""
    T, H, _ = q.shape
    S, KVH, _ = k.shape
    out = torch.empty(T, H, q.shape[-1], dtype=torch.float64)
    query_pos = torch.arange(S - T, S)[:, None]
    visible = torch.arange(S)[None, :] <= query_pos  # [T, S]
    for h in range(H):
        kh = h // (H // KVH)  # query heads h*KVH/H share kv head kh
        scores = (q[:, h].double() @ k[:, kh].double().T) * scale  # [T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = scores.softmax(dim=-1) @ v[:, kh].double()
    return out


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------- the reference itself, against the formula


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_torch_prefill_matches_naive_formula(ratio):
    H, KVH, D = 2 * ratio, 2, 16
    q, k, v, cu, max_len = packed_prompts(LENS, H, KVH, D, views=True)
    out = TorchBackend().prefill(q, k, v, cu, max_len, D**-0.5)
    assert out.shape == (sum(LENS), H, D) and out.dtype == q.dtype
    b = cu.tolist()
    ref = torch.cat([naive_attention(q[s:e], k[s:e], v[s:e], D**-0.5) for s, e in zip(b[:-1], b[1:])])
    assert max_err(out, ref) < 1e-5


@pytest.mark.parametrize("ratio", [1, 3])
def test_torch_decode_matches_naive_formula(ratio):
    H, KVH, D = 2 * ratio, 2, 16
    lens, slots = [1, 40, 17, 29], [3, 0, 5, 1]
    q, kc, vc, slot_ids, seq_lens = cache_batch(lens, slots, H, KVH, D, max_len=40, num_slots=6)
    out = TorchBackend().decode(q, kc, vc, slot_ids, seq_lens, D**-0.5)
    for b, (n, s) in enumerate(zip(lens, slots)):  # the one query is the newest token: it sees all n keys
        ref = naive_attention(q[b : b + 1], kc[s, :n], vc[s, :n], D**-0.5)
        assert max_err(out[b : b + 1], ref) < 1e-5


# ---------------------------------------------------------------- our triton kernels against torch (CPU: interpreter)

# (kv-head ratio, head_dim): every GQA ratio 1..4 and head dims 16, 64, 80 (not a power of two), 128.
CASES = [(1, 16), (2, 80), (3, 64), (4, 128)]


@pytest.mark.parametrize("ratio, D", CASES)
@pytest.mark.parametrize("blocks", [(None, None), (32, 16)], ids=["default-blocks", "small-blocks"])
def test_triton_prefill_matches_torch(tb, ratio, D, blocks):
    # small-blocks: 4 query blocks and up to 7 key blocks for the 100-token prompt: online-softmax rescaling across
    # blocks, a partial last block, and skipped key blocks above the diagonal all happen.
    H, KVH = 2 * ratio, 2
    q, k, v, cu, max_len = packed_prompts(LENS, H, KVH, D, views=(ratio == 2))
    out = tb.TritonBackend(*blocks).prefill(q, k, v, cu, max_len, D**-0.5)
    ref = TorchBackend().prefill(q, k, v, cu, max_len, D**-0.5)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert max_err(out, ref) < 1e-4


@pytest.mark.parametrize("ratio, D", CASES)
def test_triton_decode_matches_torch(tb, ratio, D):
    H, KVH, max_len = 2 * ratio, 2, 70
    lens, slots = [1, 70, 33, 64, 17], [5, 0, 7, 2, 3]  # permuted slots, lengths 1 .. max_len
    slot_major = ratio % 2 == 1
    q, kc, vc, slot_ids, seq_lens = cache_batch(lens, slots, H, KVH, D, max_len=max_len, num_slots=8,
                                                slot_major=slot_major)
    # One layer of the 5-D cache, read in place: mid-storage, and for slot_major through non-contiguous strides.
    assert kc.storage_offset() > 0 and kc.is_contiguous() != slot_major
    out = tb.TritonBackend(decode_block_n=16).decode(q, kc, vc, slot_ids, seq_lens, D**-0.5)
    ref = TorchBackend().decode(q, kc, vc, slot_ids, seq_lens, D**-0.5)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert max_err(out, ref) < 1e-4


# The flash-decoding shape: (GROUP = H // KVH, KVH, head_dim, num_kv_splits, seq_lens). With 16-key blocks a
# 70-token context cut in 4 splits is [0, 32), [32, 64), [64, 70) and one empty split; lengths below the number of
# splits leave most splits empty; seq_len 0 is a padding row (every split empty).
DECODE_CASES = [
    (1, 2, 32, 1, [1]),
    (2, 2, 48, 3, [5, 0, 2]),
    (3, 1, 64, 4, [1, 70, 33, 2, 64, 17]),
    (4, 2, 80, 8, [7, 0, 50, 3, 1, 69, 16]),
    (8, 1, 128, 2, [40, 1, 70, 0]),
    (3, 3, 64, 16, [70, 9]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group, KVH, D, splits, lens", DECODE_CASES,
                         ids=[f"group{c[0]}-d{c[2]}-splits{c[3]}-b{len(c[4])}" for c in DECODE_CASES])
def test_triton_flash_decoding_matches_torch(tb, group, KVH, D, splits, lens, dtype):
    H, B = group * KVH, len(lens)
    slots = [(7 * b + 3) % (B + 2) for b in range(B)]  # distinct rows, out of order, some rows unused
    q, kc, vc, slot_ids, seq_lens = cache_batch(lens, slots, H, KVH, D, max_len=70, num_slots=B + 2, dtype=dtype,
                                                slot_major=(group % 2 == 1))
    out = tb.TritonBackend(decode_block_n=16, num_kv_splits=splits).decode(q, kc, vc, slot_ids, seq_lens, D**-0.5)
    ref = TorchBackend().decode(q.float(), kc.float(), vc.float(), slot_ids, seq_lens, D**-0.5)
    assert out.shape == (B, H, D) and out.dtype == dtype
    assert not out.isnan().any()
    pad = torch.tensor(lens) == 0
    assert (out[pad] == 0).all()  # a padding row attends to nothing: zeros, whatever the reference's convention
    if dtype == torch.float32:
        assert max_err(out[~pad], ref[~pad]) < 1e-5
    else:  # fp32 math inside, one final rounding to bf16: within half a bf16 ulp of the fp32 answer
        assert ((out.float() - ref).abs()[~pad] <= ref.abs()[~pad] * 2**-8 + 1e-6).all()


def test_triton_num_kv_splits_is_checked(tb):
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_kv_splits must be an integer >= 1"):
            tb.TritonBackend(num_kv_splits=bad)


def test_triton_bf16_on_cpu(tb):
    # bf16 is where the interpreter needs help (tiles cast to fp32 before tl.dot, final rounding done by torch):
    # the result must equal the fp32 attention of the same bf16 inputs up to bf16 rounding (half an ulp).
    H, KVH, D = 4, 2, 64
    q, k, v, cu, max_len = packed_prompts([5, 40], H, KVH, D, dtype=torch.bfloat16)
    out = tb.TritonBackend(32, 16).prefill(q, k, v, cu, max_len, D**-0.5)
    ref = TorchBackend().prefill(q.float(), k.float(), v.float(), cu, max_len, D**-0.5)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    qd, kc, vc, slot_ids, seq_lens = cache_batch([3, 50], [1, 0], H, KVH, D, 50, 2, dtype=torch.bfloat16)
    out = tb.TritonBackend(decode_block_n=16).decode(qd, kc, vc, slot_ids, seq_lens, D**-0.5)
    ref = TorchBackend().decode(qd.float(), kc.float(), vc.float(), slot_ids, seq_lens, D**-0.5)
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter default applies only where there is no CUDA")
def test_triton_backend_runs_on_cpu_in_a_fresh_process():
    pytest.importorskip("triton")
    # The real user path: no TRITON_INTERPRET in the environment, `--attention-backend triton` on a CPU. Also checks
    # that importing the package alone does not import triton.
    code = textwrap.dedent("""
        import sys, torch
        from stage2_batch.attention import create_backend
        assert "triton" not in sys.modules, "importing the package imported triton"
        tr, ref = create_backend("triton", "cpu"), create_backend("torch", "cpu")
        q, k, v = torch.randn(9, 4, 32), torch.randn(9, 2, 32), torch.randn(9, 2, 32)
        cu = torch.tensor([0, 2, 9], dtype=torch.int32)
        err = (tr.prefill(q, k, v, cu, 7, 0.2) - ref.prefill(q, k, v, cu, 7, 0.2)).abs().max().item()
        assert err < 1e-5, err
        print("ok", type(tr).__name__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok TritonBackend" in res.stdout


# ---------------------------------------------------------------- choosing a backend


def test_create_backend_choices_and_errors():
    assert BACKENDS == ("torch", "triton", "flash_attn")
    assert default_backend("cpu") == "torch"
    assert create_backend(None, "cpu").name == "torch"
    assert create_backend("torch", torch.device("cpu")).name == "torch"
    avail = available_backends("cpu")
    assert "torch" in avail and "flash_attn" not in avail  # flash_attn is CUDA only
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*torch, triton, flash_attn"):
        create_backend("nope", "cpu")
    with pytest.raises(ValueError, match=r"flash_attn .*available here: torch"):
        create_backend("flash_attn", "cpu")


def test_flash_attn_backend_explains_a_missing_install():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    from stage2_batch.attention.flash_attn_backend import FlashAttnBackend

    with pytest.raises(ImportError, match="pip wheels need CUDA"):
        FlashAttnBackend()


def test_triton_availability_follows_the_install():
    if importlib.util.find_spec("triton") is None:
        assert "triton" not in available_backends("cpu")
        with pytest.raises(ValueError, match="triton is not installed"):
            create_backend("triton", "cpu")
        return
    from stage2_batch.attention import triton_backend

    # On a CPU triton is available exactly when its kernels can run in interpreter mode.
    usable = triton_backend.INTERPRET and not triton_backend.INTERPRETER_BROKEN
    assert ("triton" in available_backends("cpu")) == usable
    if not HAS_CUDA:
        assert triton_backend.INTERPRET  # the module's own default, with TRITON_INTERPRET unset


# ---------------------------------------------------------------- GPU (skipped without CUDA)

GPU_LENS = [1, 17, 128, 500, 1000, 2048]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, KVH, D", [(32, 8, 128), (9, 3, 64), (16, 16, 80), (8, 2, 256)])
def test_triton_matches_torch_on_cuda(tb, dtype, tol, H, KVH, D):
    # Both compared with fp32 attention of the same (possibly bf16) inputs.
    q, k, v, cu, max_len = packed_prompts(GPU_LENS, H, KVH, D, dtype=dtype, device="cuda", views=True)
    ref = TorchBackend().prefill(q.float(), k.float(), v.float(), cu, max_len, D**-0.5)
    out = tb.TritonBackend().prefill(q, k, v, cu, max_len, D**-0.5)
    assert out.dtype == dtype and max_err(out, ref) < tol

    lens = [1, 2048, 77, 1500, 512, 3, 2000, 1024]
    slots = [9, 0, 15, 3, 7, 1, 12, 5]
    q, kc, vc, slot_ids, seq_lens = cache_batch(lens, slots, H, KVH, D, max_len=2048, num_slots=16, layers=2,
                                                dtype=dtype, device="cuda")
    ref = TorchBackend().decode(q.float(), kc.float(), vc.float(), slot_ids, seq_lens, D**-0.5)
    out = tb.TritonBackend().decode(q, kc, vc, slot_ids, seq_lens, D**-0.5)
    assert out.dtype == dtype and max_err(out, ref) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 8, 16])
@pytest.mark.parametrize("H, KVH, D", [(32, 8, 128), (9, 3, 64), (8, 1, 80)])
def test_flash_decoding_splits_on_cuda(tb, splits, H, KVH, D):
    # The compiled kernels (tl.dot on [16, D] group tiles, the combine) with 1..16 splits: a padding row, a 1-token
    # context, lengths below the split count, long ones; bf16, against fp32 attention of the same inputs.
    lens, slots = [0, 1, 5, 8191, 16, 3000, 8192], [3, 0, 6, 1, 2, 5, 4]
    q, kc, vc, slot_ids, seq_lens = cache_batch(lens, slots, H, KVH, D, max_len=8192, num_slots=7, layers=2,
                                                dtype=torch.bfloat16, device="cuda")
    ref = TorchBackend().decode(q.float(), kc.float(), vc.float(), slot_ids, seq_lens, D**-0.5)
    out = tb.TritonBackend(num_kv_splits=splits).decode(q, kc, vc, slot_ids, seq_lens, D**-0.5)
    pad = torch.tensor(lens, device="cuda") == 0
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and (out[pad] == 0).all()
    assert max_err(out[~pad], ref[~pad]) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("H, KVH, D", [(32, 8, 128), (9, 3, 64)])
def test_flash_attn_matches_torch_on_cuda(H, KVH, D):
    pytest.importorskip("flash_attn")
    fa = create_backend("flash_attn", "cuda")
    q, k, v, cu, max_len = packed_prompts(GPU_LENS, H, KVH, D, dtype=torch.bfloat16, device="cuda")
    ref = TorchBackend().prefill(q.float(), k.float(), v.float(), cu, max_len, D**-0.5)
    assert max_err(fa.prefill(q, k, v, cu, max_len, D**-0.5), ref) < 2e-2
    lens, slots = [1, 2048, 77, 1500], [9, 0, 15, 3]
    q, kc, vc, slot_ids, seq_lens = cache_batch(lens, slots, H, KVH, D, max_len=2048, num_slots=16, layers=2,
                                                dtype=torch.bfloat16, device="cuda")
    ref = TorchBackend().decode(q.float(), kc.float(), vc.float(), slot_ids, seq_lens, D**-0.5)
    assert max_err(fa.decode(q, kc, vc, slot_ids, seq_lens, D**-0.5), ref) < 2e-2


@pytest.mark.cuda
def test_default_backend_on_cuda_is_triton(tb):
    assert default_backend("cuda") == "triton"
    assert create_backend(None, "cuda").name == "triton"
