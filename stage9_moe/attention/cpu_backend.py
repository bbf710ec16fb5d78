"""The CPU backend: the torch backend's prefill, and a decode that reads the paged KV cache in
place.

The torch backend's decode copies every request's keys and values out of the pool (`index_select`
through `kv_indices`) into dense groups, and SDPA then reads the copies: each K/V row is read twice
and written once per step and layer, and the copies are fresh memory every time. PyTorch has no
attention that reads a paged cache, so this backend brings a small one of its own, in C++
(`cpu_kernels.cpp`, compiled on first use with torch's extension loader, as SGLang's `sgl-kernel`
and vLLM's CPU build bring theirs):

    scores = paged_qk(q, k_cache, page_table, req_rows, seq_lens)   # [B, H, max_len] float32
    probs  = softmax(scores)                                        # -inf past each seq_len
    out    = paged_pv(probs, v_cache, page_table, req_rows, seq_lens)  # [B, H, D]

Both kernels look each key up through the page table as they read it, so each K/V row is read once,
nothing is copied, and no request is padded with keys (only its row of scores). They read
`seq_lens` and the page table from tensors, so the same call works under stage 5's graphs.

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
    try:
        module = load(name=f"paged_attention_cpu_{digest}", sources=[str(SOURCE)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
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
                           seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each request attends to its first seq_lens[b] cached keys
    (max_len >= every seq_len sizes the scores)."""
    kernels = load_kernels()
    q = q.contiguous()
    # [B, H, max_len] float32
    scores = kernels.paged_qk(q, k_cache, page_table, req_rows, seq_lens, max_len, scale)
    probs = torch.softmax(scores, dim=-1)
    return kernels.paged_pv(probs, v_cache, page_table, req_rows, seq_lens, q)


@paged_decode_attention.register_fake
def _(q, k_cache, v_cache, page_table, req_rows, seq_lens, max_len, scale):
    return torch.empty_like(q)


class CpuBackend(TorchBackend):
    name = "cpu"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.phase == "decode":  # the kernels read the page table themselves
            fb.attn_metadata = None
        else:  # prefill: the torch backend's layout
            super().init_forward_metadata(fb)

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        return paged_decode_attention(q, k_cache, v_cache, fb.page_table, fb.req_rows,
                                      fb.seq_lens, fb.max_seq_len, scale)  # [B, H, D]
