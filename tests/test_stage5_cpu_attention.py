"""Stage 5's cpu attention backend: its C++ decode and extend (attention/cpu_kernels.cpp) read the paged cache in
place, checked against the torch reference on the batches stage 4's tests build (tests/test_stage4_attention.py:
random page layouts, strided pools and queries, padding rows), and the float64 formula; and the CPU's default
backend from stage 5 on: the C++ kernels, or torch with one message where they cannot build.
"""

from __future__ import annotations

import pytest
import torch

# stage 4's batch builders; importing that module also sets TRITON_INTERPRET before anything imports triton
from tests.test_stage4_attention import (PAGED_DECODE_CASES, decode_reqs, extend_reqs, max_err, naive_attention,
                                         paged_batch, run)

from stage5_cudagraph import attention
from stage5_cudagraph.attention import BACKENDS, available_backends, create_backend, default_backend
from stage5_cudagraph.attention import cpu_backend as cpu_module
from stage5_cudagraph.attention.torch_backend import TorchBackend


# ---------------------------------------------------------------- the cpu backend's C++ decode against torch


@pytest.fixture(scope="module")
def cpu_backend():
    """The cpu backend (its kernels built on first use), or a clean skip where they cannot build."""
    if "cpu" not in available_backends("cpu"):
        from stage5_cudagraph.attention import _unavailable_reason

        pytest.skip(_unavailable_reason("cpu", torch.device("cpu")))
    return create_backend("cpu", "cpu")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group, KVH, D, page_size, splits, lens", PAGED_DECODE_CASES,
                         ids=[f"group{c[0]}-d{c[2]}-page{c[3]}-b{len(c[5])}" for c in PAGED_DECODE_CASES])
def test_cpu_decode_matches_torch(cpu_backend, group, KVH, D, page_size, splits, lens, dtype, tol):
    # The Triton cases' shapes: page boundaries, 1-key requests, a strided pool (page_major) and a strided q; a
    # seq_len 0 row (a graph's padding) gives zeros instead of reading its page-table row.
    H = group * KVH
    d = paged_batch([(max(n, 1) - 1, 1) for n in lens], H, KVH, D, page_size, phase="decode", dtype=dtype,
                    page_major=(group % 2 == 1), q_view=(group == 2))
    out = run(cpu_backend, d, D**-0.5)
    assert d["fb"].attn_metadata is None  # decode needs no host-side layout: the kernels read the page table
    ref = run(TorchBackend(), d, D**-0.5)
    assert out.shape == ref.shape and out.dtype == dtype
    assert max_err(out, ref) < tol
    fb = d["fb"]
    fb.seq_lens = torch.tensor(lens, dtype=torch.int32)
    live = [i for i, n in enumerate(lens) if n > 0]
    padded = cpu_backend.decode(d["q"], d["k_cache"], d["v_cache"], fb, D**-0.5)
    assert torch.equal(padded[live], out[live]) and not padded[[i for i in range(len(lens)) if lens[i] == 0]].any()


# (query heads, K/V heads, head_dim, page_size): head dims 64 and 128 take the AVX-512 pass where the CPU has it, 16
# and 80 the portable one; 9 query heads (SmolLM2's) make items of 7 tokens, 32 of 2.
CPU_EXTEND_CASES = [(6, 2, 16, 4), (9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 80, 1), (2, 1, 64, 4)]


# bf16: the two round their float32 results to bfloat16 apart, one step there (2^-6 for outputs in [2, 4))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, KVH, D, page_size", CPU_EXTEND_CASES, ids=[f"h{c[0]}-kv{c[1]}-d{c[2]}-page{c[3]}"
                                                                           for c in CPU_EXTEND_CASES])
def test_cpu_extend_matches_torch(cpu_backend, H, KVH, D, page_size, dtype, tol):
    # Fresh prompts, cached prefixes that end mid-page, one new token after a long prefix, and a 70-token prompt
    # (several items and key blocks, the causal edge inside a block): every query sees exactly keys 0 .. itself.
    reqs = extend_reqs(page_size) + [(0, 70), (5, 64)]
    d = paged_batch(reqs, H, KVH, D, page_size, dtype=dtype, page_major=(H == 9), q_view=(H == 6))
    out = run(cpu_backend, d, D**-0.5)
    assert d["fb"].attn_metadata is None  # no host-side layout: the kernel reads the page table
    ref = run(TorchBackend(), d, D**-0.5)
    assert out.shape == ref.shape and out.dtype == dtype
    assert max_err(out, ref) < tol
    if dtype == torch.float32:  # and against the formula itself, in float64
        cu = d["fb"].cu_seqlens.tolist()
        for b in range(len(reqs)):
            want = naive_attention(d["q"][cu[b] : cu[b + 1]], d["k_full"][b], d["v_full"][b], D**-0.5)
            assert max_err(out[cu[b] : cu[b + 1]], want) < tol


def test_cpu_extend_refuses_inconsistent_lengths(cpu_backend):
    d = paged_batch(extend_reqs(4), 6, 2, 16, 4)
    d["fb"].seq_lens = torch.ones_like(d["fb"].seq_lens)  # fewer keys than new tokens
    with pytest.raises(RuntimeError, match="seq_len below its new tokens"):
        run(cpu_backend, d, 0.25)


def test_cpu_backend_refuses_what_its_kernels_cannot_read(cpu_backend):
    d = paged_batch(decode_reqs(4), 4, 2, 16, 4, phase="decode")
    fb = d["fb"]
    fb.page_table = fb.page_table.long()
    with pytest.raises(RuntimeError, match="int32"):
        run(cpu_backend, d, 0.25)
    with pytest.raises(ValueError, match="kernels run on a CPU, got meta"):
        create_backend("cpu", "meta")


# ---------------------------------------------------------------- the CPU's default backend


def test_the_cpu_default_is_the_cpp_backend(cpu_backend):
    assert BACKENDS == ("torch", "cpu", "triton", "flash_attn")
    assert default_backend("cpu") == "cpu"
    assert create_backend(None, "cpu").name == "cpu"
    assert {"torch", "cpu"} <= set(available_backends("cpu")) and "flash_attn" not in available_backends("cpu")
    assert create_backend("torch", "cpu").name == "torch"  # the reference can still be asked for


def test_the_cpu_default_falls_back_to_torch_saying_why_once(monkeypatch, capsys):
    monkeypatch.setattr(cpu_module, "_kernels", [])
    monkeypatch.setattr(cpu_module, "_build_error", ["the CPU attention kernels did not build: no compiler"])
    monkeypatch.setattr(attention, "_fallback_said", [])
    assert default_backend("cpu") == "torch" and create_backend(None, "cpu").name == "torch"
    err = capsys.readouterr().err
    assert err.count("no compiler; using the torch backend instead") == 1  # two lookups, one message
    with pytest.raises(ValueError, match="no compiler"):  # asked for by name it still refuses, with the reason
        create_backend("cpu", "cpu")


def test_every_stage_builds_one_copy_and_a_build_is_announced(monkeypatch, capsys, tmp_path):
    """The build compiles a copy of the source kept in its cache folder, so the stages that share the source share
    one build (torch's build file names the source's path: a path per stage would rebuild at every switch); a
    build is announced on stderr, loading a cached one is not."""
    import torch.utils.cpp_extension as cpp_extension

    loaded = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: loaded.append(kwargs) or kwargs["name"])
    monkeypatch.setattr(cpu_module, "build_folder", lambda name: tmp_path)
    name = cpu_module.build_extension(cpu_module.SOURCE, "paged_attention_cpu")
    assert name.startswith("paged_attention_cpu_")
    assert loaded[-1]["sources"] == [str(tmp_path / "cpu_kernels.cpp")]
    assert (tmp_path / "cpu_kernels.cpp").read_bytes() == cpu_module.SOURCE.read_bytes()
    assert "[building cpu_kernels.cpp" in capsys.readouterr().err
    (tmp_path / f"{name}.so").write_bytes(b"")  # what a finished build leaves
    cpu_module.build_extension(cpu_module.SOURCE, "paged_attention_cpu")
    assert loaded[-1]["sources"] == [str(tmp_path / "cpu_kernels.cpp")]
    assert capsys.readouterr().err == ""
