"""Stage 3's exercises: the merged-linear weight loader, RoPE and its scaling, checkpoint name
mapping.

Run them with `python -m common.exercises check 3` (your copy) or `check 3 --reference`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

STAGE = "stage3_weights"


@pytest.mark.task("3.merged_linear_loader")
def test_qkv_parts_land_in_their_rows(stage):
    torch.manual_seed(0)
    layer = stage.layers.QKVLinear(8, num_heads=4, num_kv_heads=2, head_dim=2, bias=True)
    parts = {"q": torch.randn(8, 8), "k": torch.randn(4, 8), "v": torch.randn(4, 8)}
    biases = {"q": torch.randn(8), "k": torch.randn(4), "v": torch.randn(4)}
    for shard in ("v", "q", "k"):  # any order: the checkpoint decides
        layer.weight.weight_loader(layer.weight, parts[shard], shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    assert torch.equal(layer.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert torch.equal(layer.bias, torch.cat([biases["q"], biases["k"], biases["v"]]))
    x = torch.randn(5, 8)
    q, k, v = layer(x).split(layer.output_sizes, dim=-1)  # one matmul, then views
    torch.testing.assert_close(k, F.linear(x, parts["k"], biases["k"]))
    torch.testing.assert_close(q, F.linear(x, parts["q"], biases["q"]))


@pytest.mark.task("3.merged_linear_loader")
def test_gate_up_loader_refuses_bad_shards_and_shapes(stage):
    layer = stage.layers.MergedLinear(6, {0: 4, 1: 4})
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight[:4], gate) and torch.equal(layer.weight[4:], up)
    with pytest.raises(ValueError, match="2"):
        layer.weight.weight_loader(layer.weight, gate, 2)  # an unknown shard, named
    with pytest.raises(ValueError):
        layer.weight.weight_loader(layer.weight, torch.randn(5, 6), 0)  # the wrong shape


def empty_model(stage, path):
    cfg = stage.models.ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    return stage.models.build_model(cfg, "cpu", torch.float32)


@pytest.mark.task("3.name_mapping")
def test_map_name_follows_stacked_params_mapping(stage, tiny_llama_path):
    model = empty_model(stage, tiny_llama_path)

    def mapped(name):
        return stage.weights.map_name(model, f"model.{name}")

    qkv = "model.layers.2.self_attn.qkv_proj.weight"
    assert mapped("layers.2.self_attn.k_proj.weight") == (qkv, "k")
    assert mapped("layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert mapped("layers.0.mlp.down_proj.weight") == ("model.layers.0.mlp.down_proj.weight", None)
    assert mapped("norm.weight") == ("model.norm.weight", None)


@pytest.mark.task("3.name_mapping")
def test_expected_pieces_lists_every_shard(stage, tiny_llama_path):
    model = empty_model(stage, tiny_llama_path)
    pieces = stage.weights.expected_pieces(model)
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    for s in "qkv":
        assert pieces[(qkv, s)] == f"model.layers.1.self_attn.{s}_proj.weight"
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    assert pieces[(gate_up, 0)] == "model.layers.1.mlp.gate_proj.weight"
    assert pieces[("model.embed_tokens.weight", None)] == "model.embed_tokens.weight"
    assert (qkv, None) not in pieces
    per_param = [3 if "qkv_proj" in n else 2 if "gate_up_proj" in n else 1
                 for n, _ in model.named_parameters()]
    assert len(pieces) == sum(per_param)


@pytest.mark.task("3.name_mapping")
def test_loading_a_checkpoint_fills_the_merged_parameters(stage):
    from common.models import resolve_model

    path = resolve_model("tiny-qwen2")  # q/k/v carry biases too
    model = empty_model(stage, path)
    stage.weights.load_weights(model, path, progress=False)
    params = dict(model.named_parameters())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        get = f.get_tensor
        for kind in ("weight", "bias"):
            want = torch.cat([get(f"model.layers.0.self_attn.{p}_proj.{kind}") for p in "qkv"])
            assert torch.equal(params[f"model.layers.0.self_attn.qkv_proj.{kind}"], want)
        up = params["model.layers.1.mlp.gate_up_proj.weight"][model.config.intermediate_size :]
        assert torch.equal(up, get("model.layers.1.mlp.up_proj.weight"))


def rotate_by_definition(x, positions, inv_freq):
    """Pair i of a head is the complex number x_i + j x_{i+D/2}; RoPE multiplies it by
    e^(j * pos * inv_freq[i])."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # [N, heads, D/2]
    angle = positions[:, None, None].double() * inv_freq.double()  # [N, 1, D/2]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


@pytest.mark.task("3.rope")
def test_rope_rotates_each_pair_by_its_angle(stage):
    torch.manual_seed(0)
    rope = stage.layers.RotaryEmbedding(head_dim=16, rope_theta=10000.0)
    positions = torch.tensor([0, 1, 5, 100, 2047])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    q_rot, k_rot = rope(positions, q, k)
    for got, x in ((q_rot, q), (k_rot, k)):
        want = rotate_by_definition(x, positions, rope.inv_freq)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(q_rot[0], q[0]), "position 0 is not rotated"


@pytest.mark.task("3.rope")
def test_rope_scores_depend_only_on_the_distance(stage):
    torch.manual_seed(1)
    rope = stage.layers.RotaryEmbedding(head_dim=8, rope_theta=10000.0)
    q, k = torch.randn(1, 1, 8).repeat(2, 1, 1), torch.randn(1, 1, 8).repeat(2, 1, 1)
    q_rot, _ = rope(torch.tensor([7, 107]), q, k)  # the same query at positions 7 and 107
    _, k_rot = rope(torch.tensor([3, 103]), q, k)  # the same key at positions 3 and 103
    scores = (q_rot * k_rot).sum(-1)  # distance 4 both times
    torch.testing.assert_close(scores[0], scores[1], atol=1e-4, rtol=1e-4)
    q16, k16 = rope(torch.tensor([3, 9]), q.bfloat16(), k.bfloat16())
    assert q16.dtype == k16.dtype == torch.bfloat16


@pytest.mark.task("3.rope_scaling")
@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},  # Llama-3.2's values
], ids=["default", "linear", "llama3-small", "llama3.2"])
def test_rope_frequencies_equal_transformers(stage, rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128,
                     rope_parameters=dict(rope))
    if rope["rope_type"] == "default":  # transformers computes it inside the model: the formula
        want = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    cfg = stage.models.ModelConfig.from_hf(dict(hf.to_dict(), architectures=["LlamaForCausalLM"]))
    got = stage.layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert got.dtype == torch.float32 and got.shape == (64,)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


@pytest.mark.task("3.rope_scaling")
def test_llama3_scaling_keeps_fast_pairs_and_slows_slow_ones(stage):
    scaling = stage.models.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    plain = stage.layers.rope_inv_freq(128, 500000.0)
    scaled = stage.layers.rope_inv_freq(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    short = wavelen < 8192 / 4
    assert torch.equal(scaled[short], plain[short]), "short wavelengths unchanged"
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    medium = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    between = (scaled[medium] < plain[medium]) & (scaled[medium] > plain[medium] / 8)
    assert medium.any() and between.all()
