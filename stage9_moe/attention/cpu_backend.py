"""The CPU backend: the torch backend's prefill, and a decode that reads the paged KV cache in
place.

The torch backend's decode copies every request's keys and values out of the pool (`index_select`
through `kv_indices`) into dense groups, and SDPA then reads the copies: each K/V row is read twice
and written once per step and layer, and the copies are fresh memory every time. PyTorch has no
attention that reads a paged cache, so this backend brings a small one of its own, in C++
(`cpu_kernels.cpp`, compiled on first use with torch's extension loader, as SGLang's `sgl-kernel`
and vLLM's CPU build bring theirs):

    out = paged_decode(q, k_cache, v_cache, page_table, req_rows, seq_lens, scale)  # [B, H, D]

It looks each key up through the page table as it reads it, and makes one pass over a request's
keys with the online softmax (flash-decoding's): each K/V row is read once, nothing is copied, no
scores are stored. It reads `seq_lens` and the page table from tensors, so the same call works under
stage 5's graphs.

Building needs a C++ compiler (g++ or clang) and takes ~30 s once; the result is cached (torch's
extension cache, ~/.cache/torch_extensions). Without a compiler the backend is unavailable and
says why; "torch" is the fallback and the reference this backend is tested against.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .base import ForwardBatch
from .torch_backend import TorchBackend

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_kernels: list = []  # the built module, once
_build_error: list[str] = []


def load_kernels():
    """Compile (once per machine and source; then from torch's cache) and import the kernels."""
    if _kernels:
        return _kernels[0]
    if _build_error:
        raise RuntimeError(_build_error[0])
    from torch.utils.cpp_extension import load

    # Named by the source's hash: every stage with the same kernels shares one build.
    digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
    # at::vec's widest vectors this CPU has (AVX512, AVX2, ...), as ATen's own kernels pick them
    capability = torch.backends.cpu.get_cpu_capability()
    vectors = [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"] \
        if capability in ("AVX2", "AVX512") else []
    try:
        module = load(name=f"paged_attention_cpu_{digest}_{capability.lower()}",
                      sources=[str(SOURCE)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", *vectors],
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 — no compiler, a failed build: say why, once
        _build_error.append(f"the CPU attention kernels did not build ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''})")
        raise RuntimeError(_build_error[0]) from e
    _kernels.append(module)
    return module


# A torch operator (each stage package registers its own), so that torch.profiler names it and
# torch.compile and stage 5's graph emulator treat it as one opaque step.
_OP = f"{__name__.split('.')[0]}::paged_decode_attention"


@torch.library.custom_op(_OP, mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, req_rows: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each request attends to its first seq_lens[b] cached keys."""
    return load_kernels().paged_decode(q.contiguous(), k_cache, v_cache, page_table, req_rows,
                                       seq_lens, scale)  # [B, H, D]


@paged_decode_attention.register_fake
def _(q, k_cache, v_cache, page_table, req_rows, seq_lens, scale):
    return torch.empty_like(q)


class CpuBackend(TorchBackend):
    name = "cpu"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.phase == "decode":  # the kernel reads the page table itself
            fb.attn_metadata = None
        else:  # prefill: the torch backend's layout
            super().init_forward_metadata(fb)

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        return paged_decode_attention(q, k_cache, v_cache, fb.page_table, fb.req_rows,
                                      fb.seq_lens, scale)  # [B, H, D]
