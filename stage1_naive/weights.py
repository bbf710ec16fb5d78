"""Read the checkpoint's safetensors straight into the model.

Stage 1 keeps this minimal: read every *.safetensors file in the folder (so sharded checkpoints work
too), match names, copy. Stage 3 replaces it with a real loader (memory-mapped streaming, merged
projections, dtype handling, a strict report of what is missing or unexpected).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn


def load_weights(model: nn.Module, model_path: Path) -> None:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    params = dict(model.named_parameters())  # tied lm_head shares embed_tokens' tensor, listed once
    loaded: set[str] = set()
    for file in files:
        for ckpt_name, tensor in load_file(str(file)).items():
            # Checkpoints name the decoder "model.layers.0...", our module is the decoder itself.
            name = ckpt_name.removeprefix("model.")
            if name not in params:
                if name == "lm_head.weight" and "lm_head.weight" not in params:
                    # tied embeddings: some checkpoints still store the (identical) lm_head
                    continue
                raise KeyError(f"unexpected weight {ckpt_name!r} in {file.name}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != model "
                    f"{tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)  # converts to the model's dtype and device
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"checkpoint {model_path} lacks {len(missing)} weights, e.g. {missing[:3]}")
