"""ServerArgs (server_args.py, stages 4-9): one dataclass holds every engine option; the command line is built from
its fields, a bad value is refused by name before anything loads, and LLM(**options) is a ServerArgs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import pytest

from common.golden import discover_stages

STAGES = [s for s in discover_stages() if importlib.util.find_spec(f"{s}.server_args") is not None]

# What each lesson adds to ServerArgs: `python -m common.stages diff N-1 N` shows these fields and no others.
NEW_FIELDS = {
    "stage4_scheduler": {"model_path", "device", "dtype", "attention_backend", "max_total_tokens",
                         "mem_fraction_static", "page_size", "max_running_requests", "max_prefill_tokens",
                         "chunked_prefill_size", "schedule_conservativeness", "log_interval", "record_stats",
                         "progress"},
    "stage5_cudagraph": {"disable_cuda_graph", "cuda_graph_max_bs", "enable_torch_compile", "torch_compile_max_bs",
                         "disable_overlap"},
    "stage6_radix": {"disable_radix_cache", "schedule_policy"},
    "stage7_tp": {"tp_size", "nnodes", "node_rank", "dist_init_addr", "enable_tp_sync_check", "load_format",
                  "gpu_id_step"},
    "stage8_server": {"host", "port", "served_model_name", "log_level", "api_key", "allowed_origins",
                      "allowed_hosts", "max_request_body_bytes", "max_requests_per_call",
                      "grammar_compile_timeout"},
    "stage9_moe": {"moe_runner_backend", "kv_cache_dtype", "speculative_algorithm", "speculative_num_draft_tokens",
                   "speculative_draft_model_path", "quantization"},
}

# A bad value of an option each lesson brings, and the words its error must hold.
BAD_VALUES = {
    "stage4_scheduler": ({"chunked_prefill_size": 0}, "chunked_prefill_size must be >= 1"),
    "stage5_cudagraph": ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be >= 1, got 0"),
    "stage6_radix": ({"schedule_policy": "random"}, "unknown schedule_policy 'random'; choose one of lpm, fcfs"),
    "stage7_tp": ({"tp_size": 3, "nnodes": 2}, r"tp_size \(3\) must be a positive multiple of nnodes \(2\)"),
    "stage8_server": ({"port": 70000}, r"port must be in \[0, 65535\], got 70000"),
    "stage9_moe": ({"moe_runner_backend": "fast"}, "unknown moe_runner_backend 'fast'"),
}


def server_args_of(stage: str):
    return importlib.import_module(f"{stage}.server_args").ServerArgs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_stage_from_the_scheduler_on_has_server_args():
    assert STAGES == list(NEW_FIELDS)


@pytest.mark.parametrize("stage", STAGES)
def test_fields_grow_by_the_lesson_only(stage):
    names = {f.name for f in dataclasses.fields(server_args_of(stage))}
    earlier = set().union(*(NEW_FIELDS[s] for s in STAGES[:STAGES.index(stage)]))
    assert names == earlier | NEW_FIELDS[stage]


@pytest.mark.parametrize("stage", STAGES)
def test_every_field_is_a_flag_with_its_help_and_default(stage):
    ServerArgs = server_args_of(stage)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for f in dataclasses.fields(ServerArgs):
        action = parser._option_string_actions.get(flag(f.name))
        assert action is not None, f"no {flag(f.name)} for ServerArgs.{f.name}"
        assert action.dest == f.name and action.default == f.default
        assert action.help and action.help == f.metadata["help"], f.name
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()
    argv = ["--model", "tiny-llama", "--page-size", "4", "--mem-fraction-static", "0.5", "--no-progress",
            "--record-stats", "--attention-backend", "torch"]
    assert ServerArgs.from_cli_args(parser.parse_args(argv)) == ServerArgs(
        model_path="tiny-llama", page_size=4, mem_fraction_static=0.5, progress=False, record_stats=True,
        attention_backend="torch")


@pytest.mark.parametrize("stage", STAGES)
def test_the_stage_command_line_offers_every_field(stage, capsys):
    main = importlib.import_module(f"{stage}.__main__").main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    missing = [flag(f.name) for f in dataclasses.fields(server_args_of(stage)) if flag(f.name) not in text]
    assert not missing
    assert "--model " in text  # the course's short flag, beside SGLang's --model-path


@pytest.mark.parametrize("stage", STAGES)
def test_a_bad_value_is_refused_by_name(stage, tiny_llama_path, capsys):
    ServerArgs = server_args_of(stage)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        ServerArgs(page_size=0)
    with pytest.raises(TypeError, match="page_size must be int, got str '4'"):
        ServerArgs(page_size="4")
    with pytest.raises(TypeError, match="mem_fraction_static must be float or None, got bool"):
        ServerArgs(mem_fraction_static=True)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose one of float32"):
        ServerArgs(dtype="fp8")
    with pytest.raises(ValueError, match="mem_fraction_static must be in \\(0, 1\\), got 1.5"):
        ServerArgs(mem_fraction_static=1.5)
    kwargs, words = BAD_VALUES[stage]
    with pytest.raises(ValueError, match=words):
        ServerArgs(**kwargs)
    # The command line refuses it the same way, before the model is loaded.
    main = importlib.import_module(f"{stage}.__main__").main
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_llama_path), "--prompt", "hi", "--page-size", "0"])
    assert exit_.value.code == 2 and "page_size must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("stage", STAGES)
def test_llm_keyword_options_are_server_args(stage, tiny_llama_path):
    module = importlib.import_module(stage)
    ServerArgs = server_args_of(stage)
    path = str(tiny_llama_path)
    llm = module.LLM(path, attention_backend="torch", page_size=4, max_total_tokens=256, verbose=False)
    try:
        assert llm.server_args == ServerArgs(model_path=path, attention_backend="torch", page_size=4,
                                             max_total_tokens=256)
        assert llm.engine.kv_pool.page_size == 4 and llm.engine.kv_pool.num_pages == 64
        (out,) = llm.generate([[1, 2, 3]], module.SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3
    finally:
        getattr(llm, "close", lambda: None)()
    with pytest.raises(TypeError, match="unexpected keyword argument 'page_sise'; did you mean 'page_size'"):
        module.LLM(path, page_sise=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'warp_speed'"):
        module.LLM(path, warp_speed=9)
    again = module.LLM.from_server_args(llm.server_args, verbose=False)  # the command line's way in
    try:
        assert again.server_args == llm.server_args and again.engine.kv_pool.num_pages == 64
    finally:
        getattr(again, "close", lambda: None)()
