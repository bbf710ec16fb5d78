"""Stage 9's lesson: the MoE config, the router (exactly transformers', dtype included), the stacked experts and
their loader (both checkpoint layouts, refusals by name), the tensor-parallel slicing plan, the fused path inside
the model, and the option that picks the path. The kernels themselves: tests/test_stage9_kernels.py."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import tp_checks
from common.golden import failures, load_golden
from common.models import resolve_model
from stage9_moe import LLM, CheckpointError, SamplingParams, UnsupportedModelError, kernels
from stage9_moe.attention import ForwardBatch
from stage9_moe.engine import Engine
from stage9_moe.models import MODEL_REGISTRY, ModelConfig
from stage9_moe.moe import FusedMoE, TopK, reference_experts

MOE = ["tiny-qwen3-moe", "tiny-mixtral"]
PROMPT = [1, 450, 3411, 8, 17, 30000, 42, 9, 256, 1024, 77, 5, 600, 7000, 12, 3]


def hf_config(name: str) -> dict:
    return json.loads((resolve_model(name) / "config.json").read_text())


def hf_model(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def prompt_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """One prompt through the engine's model in one prefill -> float32 logits of its last token."""
    n, ps = len(ids), engine.kv_pool.page_size
    engine.page_table.write(0, 0, list(range(-(-n // ps))))  # pages 0, 1, ...: token p sits in slot p
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    fb = ForwardBatch(phase="prefill", input_ids=torch.tensor(ids), positions=torch.arange(n),
                      out_cache_loc=torch.arange(n), req_rows=i32([0]), prefix_lens=i32([0]), seq_lens=i32([n]),
                      cu_seqlens=i32([0, n]), max_seqlen=n, max_seq_len=n, prefix_lens_cpu=[0], seq_lens_cpu=[n],
                      last_token_indices=torch.tensor([n - 1]), kv_pool=engine.kv_pool,
                      page_table=engine.page_table.table, attn_backend=engine.attn_backend)
    engine.attn_backend.init_forward_metadata(fb)
    return engine.model(fb.input_ids, fb.positions, fb)[0].float()


# ----------------------------------------------------------------------------- config
def test_config_reads_both_spellings_of_the_moe_fields():
    saved = hf_config("tiny-qwen3-moe")  # transformers 5 writes num_local_experts for Qwen3-MoE
    hub = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 8}  # Hub's spelling
    for hf in (saved, hub):
        cfg = ModelConfig.from_hf(hf)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 48)
        assert cfg.norm_topk_prob and cfg.mlp_only_layers == (1,)
        assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mixtral = ModelConfig.from_hf(hf_config("tiny-mixtral"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 200)
    assert not mixtral.norm_topk_prob  # not in Mixtral's config.json: the model class sets it
    with torch.device("meta"):
        assert MODEL_REGISTRY["MixtralForCausalLM"](mixtral).config.norm_topk_prob
    dense = ModelConfig.from_hf(hf_config("tiny-qwen3"))
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)


@pytest.mark.parametrize("key, value", [
    ("shared_expert_intermediate_size", 512), ("n_shared_experts", 1), ("n_group", 8), ("topk_group", 4),
    ("scoring_func", "sigmoid"), ("routed_scaling_factor", 2.5), ("first_k_dense_replace", 3),
])
def test_unsupported_moe_features_are_refused_by_name(key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf(dict(hf_config("tiny-qwen3-moe"), **{key: value}))


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be an int in \\[1, 8\\]"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers \\[3\\] are not layer indices"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"num_experts": 16}, "two different expert counts"),
])
def test_inconsistent_moe_configs_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_hf(dict(hf_config("tiny-qwen3-moe"), **change))


@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (1, [0, 2]), (2, [3])])
def test_sparse_layers_are_where_transformers_puts_them(step, dense):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
              decoder_sparse_step=step, mlp_only_layers=dense)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw))
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    with torch.device("meta"):
        ours = MODEL_REGISTRY["Qwen3MoeForCausalLM"](ModelConfig.from_hf(
            dict(kw, architectures=["Qwen3MoeForCausalLM"], hidden_act="silu")))
    assert [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in ours.model.layers] == hf_sparse
    assert any(hf_sparse) and (all(hf_sparse) == (step == 1 and not dense))


# ----------------------------------------------------------------------------- the router
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_equals_transformers_bit_for_bit(family, dtype):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if family == "qwen3_moe":
        hf_router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=48, num_experts=16, num_experts_per_tok=4,
                                                      norm_topk_prob=True))
        ours = TopK(4, renormalize=True, weights_in_logits_dtype=True)
    else:
        hf_router = MixtralTopKRouter(MixtralConfig(hidden_size=48, num_local_experts=8, num_experts_per_tok=2))
        ours = TopK(2, renormalize=True, weights_in_logits_dtype=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=gen))
    hf_router = hf_router.to(dtype)
    x = torch.randn(37, 48, generator=gen).to(dtype)
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf_router(x)
    out = ours(torch.nn.functional.linear(x, hf_router.weight))
    assert torch.equal(out.router_logits, logits) and torch.equal(out.topk_ids, hf_ids)
    assert out.topk_weights.dtype == hf_weights.dtype == (dtype if family == "qwen3_moe" else torch.float32)
    assert torch.equal(out.topk_weights, hf_weights)


# ----------------------------------------------------------------------------- the model against transformers
@pytest.mark.parametrize("name", MOE)
def test_logits_match_transformers(name):
    ids = PROMPT * 3
    with torch.no_grad():
        want = hf_model(resolve_model(name))(torch.tensor([ids])).logits[0, -1]
    got = prompt_logits(Engine(resolve_model(name), verbose=False, max_total_tokens=256), ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MOE)
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(name):
    """bf16 logits of these models move by O(1) (logits are O(16), 2-3 layers of bf16 rounding); ours must stay
    as close to the float32 reference as transformers' own bf16 run, and pick the same token."""
    ids = PROMPT * 3
    with torch.no_grad():
        ref = hf_model(resolve_model(name))(torch.tensor([ids])).logits[0, -1].float()
        hf_bf16 = hf_model(resolve_model(name), torch.bfloat16)(torch.tensor([ids])).logits[0, -1].float()
    ours = prompt_logits(Engine(resolve_model(name), dtype="bfloat16", verbose=False, max_total_tokens=256), ids)
    assert (ours - ref).abs().mean() <= 1.25 * (hf_bf16 - ref).abs().mean()
    assert ours.argmax() == ref.argmax()


# ----------------------------------------------------------------------------- the loader
def _copy(name: str, tmp_path):
    dst = tmp_path / name
    shutil.copytree(resolve_model(name), dst)
    return dst


def _rewrite(folder, edit) -> None:
    file = folder / "model.safetensors"
    save_file(edit(load_file(file)), file, metadata={"format": "pt"})


def _stacked_copy(name: str, tmp_path):
    """The same checkpoint as transformers 5 writes it with save_original_format=False: experts stacked."""
    dst = tmp_path / f"{name}-stacked"
    shutil.copytree(resolve_model(name), dst)
    (dst / "model.safetensors").unlink()
    hf_model(resolve_model(name)).save_pretrained(dst, save_original_format=False)
    return dst


@pytest.mark.parametrize("name", MOE)
def test_both_checkpoint_layouts_load_the_same_weights(name, tmp_path):
    per_expert, stacked = resolve_model(name), _stacked_copy(name, tmp_path)
    names = set(load_file(stacked / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any(".experts.0." in n for n in names)
    expert_name = {"tiny-qwen3-moe": "model.layers.0.mlp.experts.3.up_proj.weight",
                   "tiny-mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight"}[name]
    assert expert_name in load_file(per_expert / "model.safetensors")
    a, b = Engine(per_expert, verbose=False, max_total_tokens=64), Engine(stacked, verbose=False, max_total_tokens=64)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    # a packed (oneDNN-layout) weight compares through its plain values
    dense = {k: (p.to_dense() if p.is_mkldnn else p) for k, p in pb.items()}
    assert pa.keys() == pb.keys()
    assert all(torch.equal(p.to_dense() if p.is_mkldnn else p, dense[k]) for k, p in pa.items())
    # and the stacked parameters hold what the checkpoint says: gate rows, then up rows, of each expert
    w = load_file(per_expert / "model.safetensors")
    up = w[expert_name]
    w13 = pa["model.layers.0.mlp.experts.w13_weight"]
    assert torch.equal(w13[3, up.shape[0]:], up)


def test_a_missing_expert_is_named(tmp_path):
    folder = _copy("tiny-qwen3-moe", tmp_path)
    gone = "model.layers.2.mlp.experts.5.down_proj.weight"
    _rewrite(folder, lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(CheckpointError, match=f"1 missing tensor\\(s\\): {gone}"):
        Engine(folder, verbose=False)


def test_an_extra_expert_is_named(tmp_path):
    folder = _copy("tiny-mixtral", tmp_path)
    extra = "model.layers.1.block_sparse_moe.experts.4.w1.weight"  # tiny-mixtral has experts 0-3
    _rewrite(folder, lambda t: dict(t, **{extra: t["model.layers.1.block_sparse_moe.experts.0.w1.weight"].clone()}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor\\(s\\): {extra}"):
        Engine(folder, verbose=False)


@pytest.mark.parametrize("stacked", [False, True])
def test_a_wrong_expert_shape_is_refused_before_loading(tmp_path, stacked):
    folder = _stacked_copy("tiny-qwen3-moe", tmp_path) if stacked else _copy("tiny-qwen3-moe", tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj" if stacked else "model.layers.0.mlp.experts.7.gate_proj.weight"
    _rewrite(folder, lambda t: {k: (v[..., :-1].contiguous() if k == name else v) for k, v in t.items()})
    want = r"\(8, 96, 63\) != \(8, 96, 64\)" if stacked else r"\(48, 63\) != \(48, 64\)"
    with pytest.raises(CheckpointError, match=f"{name} in model.safetensors -> model.layers.0.mlp.experts.w13_weight "
                                              f"shard .*checkpoint shape {want}"):
        Engine(folder, verbose=False)


def test_a_checkpoint_mixing_both_layouts_is_refused_by_name(tmp_path):
    folder = _stacked_copy("tiny-qwen3-moe", tmp_path)
    per_expert = {k: v for k, v in load_file(resolve_model("tiny-qwen3-moe") / "model.safetensors").items()
                  if k.startswith("model.layers.2.mlp.experts.")}
    _rewrite(folder, lambda t: {**{k: v for k, v in t.items() if not k.startswith("model.layers.2.mlp.experts.")},
                                **per_expert})
    with pytest.raises(CheckpointError) as err:
        Engine(folder, verbose=False)
    msg = str(err.value)
    assert "missing tensor(s): model.layers.2.mlp.experts.down_proj, model.layers.2.mlp.experts.gate_up_proj" in msg
    assert "unexpected tensor(s): model.layers.2.mlp.experts.0.down_proj.weight" in msg


def test_a_mixtral_checkpoint_labelled_qwen3_moe_is_refused(tmp_path):
    folder = _copy("tiny-mixtral", tmp_path)
    (folder / "config.json").write_text(json.dumps(dict(hf_config("tiny-mixtral"),
                                                        architectures=["Qwen3MoeForCausalLM"])))
    with pytest.raises(CheckpointError, match="block_sparse_moe"):
        Engine(folder, verbose=False)


# ----------------------------------------------------------------------------- tensor parallelism, on one process
def _expert_tensors(E, H, I, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"w1": torch.randn(I, H, generator=gen) / H ** 0.5, "w3": torch.randn(I, H, generator=gen) / H ** 0.5,
             "w2": torch.randn(H, I, generator=gen) / I ** 0.5} for _ in range(E)]


def _load(layer: FusedMoE, experts: list[dict], stacked: bool) -> None:
    if stacked:  # transformers' layout: [E, 2I, H] gate rows then up rows; [E, H, I]
        gate_up = torch.stack([torch.cat([e["w1"], e["w3"]]) for e in experts])
        layer.weight_loader(layer.w13_weight, gate_up, (None, "w13"))
        layer.weight_loader(layer.w2_weight, torch.stack([e["w2"] for e in experts]), (None, "w2"))
        return
    for i, e in enumerate(experts):
        for part in ("w1", "w3"):
            layer.weight_loader(layer.w13_weight, e[part], (i, part))
        layer.weight_loader(layer.w2_weight, e["w2"], (i, "w2"))


@pytest.mark.parametrize("tp_size", [2, 3])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("runner", ["torch", "triton"])
def test_tp_slices_sum_to_the_full_output(tp_size, stacked, runner):
    """Each rank holds I / tp rows of every expert's gate and up and the matching columns of down; the router is
    replicated; the ranks' partial outputs add up to the full layer (the all-reduce's job)."""
    E, k, H, I, N = 8, 2, 40, 48, 23
    experts = _expert_tensors(E, H, I)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, H, generator=gen)
    topk = TopK(k, renormalize=True, weights_in_logits_dtype=True)(torch.randn(N, E, generator=gen))
    full = FusedMoE(E, k, H, I, runner_backend=runner)
    _load(full, experts, stacked)
    want = full(x, topk)
    ranks = [FusedMoE(E, k, H, I, tp_rank=r, tp_size=tp_size, runner_backend=runner) for r in range(tp_size)]
    Ip = I // tp_size
    for r, layer in enumerate(ranks):
        _load(layer, experts, stacked)
        assert layer.w13_weight.shape == (E, 2 * Ip, H) and layer.w2_weight.shape == (E, H, Ip)
        assert torch.equal(layer.w13_weight[5, :Ip], experts[5]["w1"][r * Ip:(r + 1) * Ip])  # gate slice
        assert torch.equal(layer.w13_weight[5, Ip:], experts[5]["w3"][r * Ip:(r + 1) * Ip])  # up slice
        assert torch.equal(layer.w2_weight[5], experts[5]["w2"][:, r * Ip:(r + 1) * Ip])  # down columns
    partials = [layer(x, topk) for layer in ranks]
    assert not torch.allclose(partials[0], want, atol=1e-3)  # one rank alone is not the answer
    torch.testing.assert_close(sum(partials), want, atol=1e-5, rtol=1e-5)


def test_tp_sizes_that_do_not_divide_the_experts_are_refused():
    with pytest.raises(ValueError, match="cannot split an expert's 48 intermediate rows over 5 ranks"):
        FusedMoE(4, 2, 16, 48, tp_rank=0, tp_size=5)
    layer = FusedMoE(4, 2, 16, 48)
    with pytest.raises(ValueError, match="expert 4 does not exist"):
        layer.weight_loader(layer.w13_weight, torch.zeros(48, 16), (4, "w1"))
    with pytest.raises(ValueError, match="expert shard_id must be"):
        layer.weight_loader(layer.w13_weight, torch.zeros(48, 16), "w1")
    assert layer.checkpoint_shape((3, "w2")) == (16, 48) and layer.checkpoint_shape((None, "w13")) == (4, 96, 16)
    assert FusedMoE(4, 2, 16, 48, tp_rank=1, tp_size=2).checkpoint_shape((0, "w1")) == (48, 16)  # full, unsliced


# ----------------------------------------------------------------------------- the path, in the model
def test_cpu_default_runs_the_reference_path(monkeypatch):
    calls = []
    monkeypatch.setattr("stage9_moe.moe.reference_experts",
                        lambda *a: calls.append("reference") or reference_experts(*a))
    llm = LLM(str(resolve_model("tiny-qwen3-moe")), verbose=False, max_total_tokens=256)
    llm.generate(["Hello"], SamplingParams(max_new_tokens=2))
    assert calls and set(calls) == {"reference"}
    llm.close()


@pytest.mark.parametrize("name", MOE)
def test_fused_path_in_the_interpreter_gives_the_golden_tokens(name):
    """Every kernel of the model in Triton (the interpreter, here): the same greedy tokens as transformers."""
    golden = load_golden(name)
    cases = [c for c in golden["cases"] if c["name"] in ("english", "one_token")]
    n = 8
    with kernels.use_backend("triton"):
        llm = LLM(str(resolve_model(name)), verbose=False, max_total_tokens=256)
        assert all(m.use_fused(torch.zeros(1)) for m in llm.engine.model.modules() if isinstance(m, FusedMoE))
        results = llm.generate([c["prompt"] for c in cases], SamplingParams(max_new_tokens=n))
        llm.close()
    for case, result in zip(cases, results):
        assert result.token_ids == case["output_ids"][:n], case["name"]


def test_moe_runner_backend_triton_alone_gives_the_golden_tokens():
    """Only the MoE layers fused (the other kernels stay torch): the full golden run of one prompt."""
    golden = load_golden("tiny-qwen3-moe")
    case = golden["cases"][1]
    llm = LLM(str(resolve_model("tiny-qwen3-moe")), verbose=False, max_total_tokens=256, moe_runner_backend="triton")
    out = llm.generate([case["prompt"]], SamplingParams(max_new_tokens=golden["max_new_tokens"]))[0]
    llm.close()
    assert out.token_ids == case["output_ids"]


def test_fused_path_is_graph_safe_and_the_reference_is_not(monkeypatch):
    """Under the CPU graph emulator (common/graph_emulator.py), decode graphs capture the fused MoE path (no host
    sync: the grid is sized from an upper bound) and replay it to the golden tokens; the reference path's
    host-side routing is refused at capture, as a GPU would."""
    from common import graph_emulator
    from stage9_moe import graph as graph_module

    monkeypatch.setattr(graph_module, "cuda", graph_emulator)
    golden = load_golden("tiny-qwen3-moe")
    cases, n = golden["cases"][:3], 6
    llm = LLM(str(resolve_model("tiny-qwen3-moe")), verbose=False, max_total_tokens=512, cuda_graph_max_bs=4,
              moe_runner_backend="triton")
    results = llm.generate([c["prompt"] for c in cases], SamplingParams(max_new_tokens=n))
    assert llm.engine.num_graph_replays > 0
    llm.close()
    assert [r.token_ids for r in results] == [c["output_ids"][:n] for c in cases]
    with pytest.raises(graph_emulator.GraphCaptureError, match="needs the data on the host"):
        LLM(str(resolve_model("tiny-qwen3-moe")), verbose=False, max_total_tokens=512, cuda_graph_max_bs=4,
            moe_runner_backend="torch")


def test_bad_moe_runner_backend_is_refused():
    with pytest.raises(ValueError, match="unknown moe_runner_backend 'fast'"):
        LLM(str(resolve_model("tiny-qwen3-moe")), verbose=False, max_total_tokens=256, moe_runner_backend="fast")


def test_command_line(capsys):
    from stage9_moe.__main__ import main

    main(["--model", str(resolve_model("tiny-mixtral")), "--prompt", "Hi", "--max-new-tokens", "3",
          "--moe-runner-backend", "torch", "--memory-report", "--quiet", "--max-total-tokens", "256"])
    out = capsys.readouterr().out
    assert "MixtralForCausalLM" in out and "3 tokens" in out


@pytest.mark.cuda
@pytest.mark.parametrize("name", MOE)
def test_cuda_fused_model_with_graphs_gives_the_golden_tokens(name):
    """On a GPU: Triton kernels everywhere, CUDA graphs on (the fused path is captured), float32."""
    from common.golden import failures

    golden = load_golden(name)
    llm = LLM(str(resolve_model(name)), device="cuda", verbose=False)
    assert llm.engine.graph_runner is not None
    results = llm.generate([c["prompt"] for c in golden["cases"]],
                           SamplingParams(max_new_tokens=golden["max_new_tokens"]))
    assert llm.engine.num_graph_replays > 0
    llm.close()
    problems = failures(results, golden)
    assert not problems, "\n".join(problems)


@pytest.mark.cuda
def test_cuda_reference_path_refuses_graph_capture():
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        LLM(str(resolve_model("tiny-qwen3-moe")), device="cuda", verbose=False, moe_runner_backend="torch")


def test_gpu_benchmark_rehearses_on_a_cpu(tmp_path):
    """common/bench_gpu_moe.py --smoke: every step of the GPU script, on a CPU (the Triton path in the interpreter,
    the cuda tests collected and skipped)."""
    from common.bench_gpu_moe import main

    report = main(["--smoke", "--out", str(tmp_path)])
    rows = {r["path"]: r for r in report["layers"][0]["rows"]}
    assert rows["fused, Triton"]["max_abs_diff"] < 1e-5 and rows["fused, torch"]["max_abs_diff"] < 1e-5
    assert [m["model"] for m in report["models"]] == ["dense Qwen3", "Qwen3-MoE, moe_runner_backend=torch"]
    assert report["tests"]["exit_code"] == 0 and "skipped" in report["tests"]["summary"]
    assert (tmp_path / "stage9_gpu.md").read_text().count("|") > 20 and (tmp_path / "stage9_pytest_cuda.txt").exists()


# ---------------------------------------------------------------- stage 8's engine, with MoE models in it
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_golden_at_tp_2(name):
    """Each rank holds half of every expert's intermediate width; one all-reduce per MoE layer."""
    golden = load_golden(name)
    with LLM(str(resolve_model(name)), tp_size=2, max_total_tokens=8192, enable_tp_sync_check=True,
             verbose=False) as llm:
        experts = next(m for m in llm.engine.model.modules() if type(m).__name__ == "FusedMoE")
        assert experts.tp_size == 2 and experts.w13_weight.shape[1] == experts.intermediate_size  # 2 * I / 2
        results = llm.generate([c["prompt"] for c in golden["cases"]],
                               SamplingParams(max_new_tokens=golden["max_new_tokens"]))
    problems = failures(results, golden)
    assert not problems, "\n".join(problems)


def test_a_flush_and_an_abort_in_one_turn_give_a_moe_model_at_tp_2_the_cache_of_tp_1():
    results = {}
    for tp in (1, 2):
        with LLM(str(resolve_model("tiny-qwen3-moe")), tp_size=tp, max_total_tokens=4096, enable_tp_sync_check=True,
                 verbose=False) as llm:
            results[tp] = tp_checks.flush_and_abort_in_one_turn(llm, SamplingParams)
    assert [cached for _, cached in results[1]] == [48, 0] and results[2] == results[1]


def test_a_moe_model_served_gives_the_golden_tokens():
    """python -m stage9_moe serves a MoE model: the openai client gets the golden completions."""
    import signal
    import subprocess
    import sys

    import httpx
    openai = pytest.importorskip("openai")

    golden = load_golden("tiny-qwen3-moe")
    cases = [c for c in golden["cases"] if isinstance(c["prompt"], str)]
    proc = subprocess.Popen([sys.executable, "-m", "stage9_moe", "--model", str(resolve_model("tiny-qwen3-moe")),
                             "--port", "0", "--quiet", "--served-model-name", "moe", "--max-total-tokens", "8192"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = next(line.split(" at ")[1].split()[0] for line in proc.stdout if line.startswith("serving "))
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for case in cases:
            comp = client.completions.create(model="moe", prompt=case["prompt"], temperature=0,
                                             max_tokens=golden["max_new_tokens"])
            assert comp.choices[0].text == case["text"], case["name"]
        # stage 8's structured outputs, carried: a JSON schema through response_format
        chat = client.chat.completions.create(model="moe", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=64, temperature=0, response_format={
                                                  "type": "json_schema",
                                                  "json_schema": {"name": "flag", "schema": FLAG_SCHEMA}})
        assert chat.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(chat.choices[0].message.content)["ok"], bool)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}


def test_structured_outputs_from_a_moe_model():
    """Stage 8's grammar mask on stage 9's engine: a schema and a regex, greedy and sampled, at tp 1 and 2."""
    import re

    params = [SamplingParams(max_new_tokens=48, json_schema=FLAG_SCHEMA),
              SamplingParams(max_new_tokens=48, json_schema=FLAG_SCHEMA, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=16, regex=r"(yes|no), [0-9]{3}", temperature=1.0, seed=2),
              SamplingParams(max_new_tokens=8)]
    texts = {}
    for tp in (1, 2):
        with LLM(str(resolve_model("tiny-qwen3-moe")), tp_size=tp, max_total_tokens=4096,
                 enable_tp_sync_check=True, verbose=False) as llm:
            results = llm.generate(["Is it on?"] * len(params), params)
        assert [r.finish_reason for r in results[:3]] == ["stop"] * 3
        assert all(isinstance(json.loads(r.text)["ok"], bool) for r in results[:2])
        assert re.fullmatch(r"(yes|no), [0-9]{3}", results[2].text)
        texts[tp] = [results[i].text for i in (0, 3)]  # the greedy ones
    assert texts[2] == texts[1]
