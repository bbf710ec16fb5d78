"""The CPU backend: attention that reads the paged KV cache in place, for prefill and decode.

The torch backend copies every request's keys and values out of the pool (`index_select` through
`kv_indices`) into dense groups, and SDPA then reads the copies: each K/V row is read twice and
written once per step and layer, and the copies are fresh memory every time. PyTorch has no
attention that reads a paged cache, so this backend brings a small one of its own, in C++
(`cpu_kernels.cpp`, compiled on first use with torch's extension loader, as SGLang's `sgl-kernel`
and vLLM's CPU build bring theirs):

    out = paged_decode(q, k_cache, v_cache, page_table, req_rows, seq_lens, scale)      # [B, H, D]
    out = paged_extend(q, k_cache, v_cache, page_table, req_rows, cu_seqlens, seq_lens,
                       scale)                                                           # [N, H, D]

Both look each key up through the page table as they read it, and make one pass over a request's
keys with the online softmax (flash-decoding's): nothing is copied, no scores are stored. Decode
has one query per request; prefill (an extend) runs the same pass for every new token, the token
at position p seeing keys 0..p, with a few consecutive tokens of a prompt sharing each key they
read. One call covers the whole batch's prompts: the torch backend calls SDPA once per request and
layer (on a 2-core CPU, 2-3x slower than this pass for prompts of 32-256 tokens). It reads
`seq_lens` and the page table from tensors, so the same call works under stage 5's graphs.

It is the default attention on a CPU. Building needs a C++ compiler (g++ or clang) and takes ~30 s
once, announced on stderr; the result is cached (torch's extension cache,
~/.cache/torch_extensions). Without a compiler the backend is unavailable and says why, and the
default falls back to "torch" (saying so once), the reference this backend is tested against.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from .base import AttentionBackend, ForwardBatch
from .torch_backend import TorchBackend

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_kernels: list = []  # the built module, once
_build_error: list[str] = []


def build_extension(source: Path, name: str, flags: tuple[str, ...] = ()):
    """Compile a C++ file (once per machine and source; then from torch's cache) and import it.
    Raises RuntimeError saying why it did not build."""
    from torch.utils.cpp_extension import load

    # Named by the source's hash: every stage with the same file shares one build.
    digest = hashlib.sha1(source.read_bytes()).hexdigest()[:10]
    # at::vec's widest vectors this CPU has (AVX512, AVX2, ...), as ATen's own kernels pick them
    capability = torch.backends.cpu.get_cpu_capability()
    vectors = [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"] \
        if capability in ("AVX2", "AVX512") else []
    name = f"{name}_{digest}_{capability.lower()}"
    folder = build_folder(name)
    if folder is not None:
        # Compiled from one copy of the source in the build's folder: torch's build file names the
        # source's path, and another stage's path would make ninja build it all over again.
        shared = folder / source.name
        if not shared.exists() or shared.read_bytes() != source.read_bytes():
            shared.write_bytes(source.read_bytes())
        source = shared
    if folder is None or not any(folder.glob(f"{name}*.so")):
        print(f"[building {source.name} with torch's C++ extension loader: once, ~30 s; cached "
              "afterwards]", file=sys.stderr)
    try:
        return load(name=name, sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", *vectors, *flags],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 — no compiler, a failed build: say why
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        raise RuntimeError(f"{source.name} did not build ({type(e).__name__}: {last})") from e


def build_folder(name: str) -> Path | None:
    """torch's extension cache folder for this build (created if missing), or None if torch's
    private helper for it has changed (then each stage builds from its own file)."""
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001
        return None


def load_kernels():
    """The attention kernels, built on first use; the same error again if they could not build."""
    if _kernels:
        return _kernels[0]
    if _build_error:
        raise RuntimeError(_build_error[0])
    try:
        _kernels.append(build_extension(SOURCE, "paged_attention_cpu"))
        # from now on the operators below (and kv_cache.store_kv) call the C++ directly
        _kernels[0].register_ops(_PACKAGE)
    except RuntimeError as e:
        _build_error.append(f"the CPU attention kernels did not build: {e}")
        raise RuntimeError(_build_error[0]) from e
    return _kernels[0]


# Torch operators (each stage package registers its own), so that torch.profiler names them and
# torch.compile and stage 5's graph emulator treat each as one opaque step. Defined with
# torch.library.Library rather than the @custom_op decorator, whose wrapper costs ~5 us more a call
# (a micro-benchmark: ~7.7 against ~2.7 us), paid by every layer of every step.
_PACKAGE = __name__.split(".")[0]
_LIB = torch.library.Library(_PACKAGE, "FRAGMENT")
_LIB.define("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
            "Tensor req_rows, Tensor seq_lens, float scale) -> Tensor")
_LIB.define("paged_extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
            "Tensor req_rows, Tensor cu_seqlens, Tensor seq_lens, float scale) -> Tensor")


def _paged_decode(q, k_cache, v_cache, page_table, req_rows, seq_lens, scale):
    """q [B, H, D] -> [B, H, D]: each request attends to its first seq_lens[b] cached keys."""
    return load_kernels().paged_decode(q.contiguous(), k_cache, v_cache, page_table, req_rows,
                                       seq_lens, scale)  # [B, H, D]


def _paged_extend(q, k_cache, v_cache, page_table, req_rows, cu_seqlens, seq_lens, scale):
    """q [N, H, D], the new tokens of every request packed -> [N, H, D], causal over each
    request's cached keys."""
    return load_kernels().paged_extend(q.contiguous(), k_cache, v_cache, page_table, req_rows,
                                       cu_seqlens, seq_lens, scale)  # [N, H, D]


for _name, _impl in (("paged_decode_attention", _paged_decode),
                     ("paged_extend_attention", _paged_extend)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{_PACKAGE}::{_name}", lib=_LIB)(
        lambda q, *rest: torch.empty_like(q))
paged_decode_attention = getattr(torch.ops, _PACKAGE).paged_decode_attention
paged_extend_attention = getattr(torch.ops, _PACKAGE).paged_extend_attention


class CpuBackend(AttentionBackend):
    name = "cpu"
    # Stage 9: a quantized pool (kv_quant.py) is read by the torch backend's gather-and-dequantize
    # path, not by these kernels (they read float caches only): correct, without their speed.
    reads_quantized_kv = True

    def __init__(self):
        self.quantized_fallback = TorchBackend()

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.kv_pool.quantized:
            return self.quantized_fallback.init_forward_metadata(fb)
        fb.attn_metadata = None  # the kernels read the page table themselves

    def prefill_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch, scale):
        return self.quantized_fallback.prefill_quantized(q, k_cache, v_cache, kv_scales, fb, scale)

    def decode_quantized(self, q, k_cache, v_cache, kv_scales, fb: ForwardBatch, scale):
        return self.quantized_fallback.decode_quantized(q, k_cache, v_cache, kv_scales, fb, scale)

    def prefill(self, q, k, v, k_cache, v_cache, fb: ForwardBatch, scale):
        return paged_extend_attention(q, k_cache, v_cache, fb.page_table, fb.req_rows,
                                      fb.cu_seqlens, fb.seq_lens, scale)  # [N, H, D]

    def decode(self, q, k_cache, v_cache, fb: ForwardBatch, scale):
        return paged_decode_attention(q, k_cache, v_cache, fb.page_table, fb.req_rows,
                                      fb.seq_lens, scale)  # [B, H, D]
