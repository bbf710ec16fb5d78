"""Small GGUF files for the tests: a Hugging Face folder written the way llama.cpp's converter writes
it (its tensor names, q/k rows permuted for the llama family, 2-D weights in a chosen block type,
the tokenizer copied from SmolLM2's GGUF). Only what the course's tiny checkpoints need.

    python -m common.gguf_files SRC_FOLDER OUT.gguf [--type Q8_0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (interleaved rope pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def copy_tokenizer(writer, source_gguf: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source_gguf))
    get = lambda key: reader.fields[key].contents()  # noqa: E731
    writer.add_tokenizer_model(get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    writer.add_token_list(get("tokenizer.ggml.tokens"))
    writer.add_token_types(get("tokenizer.ggml.token_type"))
    writer.add_token_merges(get("tokenizer.ggml.merges"))
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unknown", writer.add_unk_token_id), ("padding", writer.add_pad_token_id)):
        add(get(f"tokenizer.ggml.{key}_token_id"))
    writer.add_add_bos_token(get("tokenizer.ggml.add_bos_token"))
    writer.add_chat_template(get("tokenizer.chat_template"))


def write_gguf(src: Path, out: Path, qtype: str = "F32", keep_float: tuple[str, ...] = ()) -> Path:
    """src: a Hugging Face folder (safetensors); 2-D weights written as `qtype` where their
    row length allows (else F32), norms and biases F32; names containing a `keep_float` fragment F32."""
    import gguf

    from common.models import _find_gguf

    cfg = json.loads((Path(src) / "config.json").read_text())
    arch = ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    copy_tokenizer(writer, _find_gguf())
    block_type = gguf.GGMLQuantizationType[qtype]
    tensors = {}
    for file in sorted(Path(src).glob("*.safetensors")):  # one file or shards
        tensors.update(load_file(str(file)))
    for name, tensor in tensors.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        w = tensor.to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in name:
            w = permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = permute(w, kv_heads)
        block = gguf.GGML_QUANT_SIZES[block_type][0]
        if (w.ndim == 2 and qtype != "F32" and w.shape[1] % block == 0
                and not any(f in name for f in keep_float)):
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, block_type),
                              raw_dtype=block_type)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def tiny_gguf(model: str, qtype: str = "F32", keep_float: tuple[str, ...] = ()) -> Path:
    """A course checkpoint (common.models) as a GGUF file, written once into the cache."""
    from common.models import CACHE_DIR, resolve_model

    suffix = "".join(f"-{f}" for f in keep_float)
    out = CACHE_DIR / "gguf-files" / f"{model}.{qtype}{suffix}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_gguf(resolve_model(model), tmp, qtype, keep_float)
        tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="F32", help="F32, Q8_0, Q4_1, ...")
    args = parser.parse_args(argv)
    print(write_gguf(args.src, args.out, args.type))


if __name__ == "__main__":
    main()
