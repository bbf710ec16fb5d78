"""Stage 1's bug-hunt checks beyond tests/exercises/stage1.py."""

from __future__ import annotations

STAGE = "stage1_naive"


def test_generation_stops_at_eos(stage, tiny_llama_path):
    engine = stage.engine.Engine(tiny_llama_path)
    Req, SP = stage.core.Req, stage.core.SamplingParams
    free = engine.generate(Req(0, [3, 1, 4, 1, 5], SP(max_new_tokens=10, ignore_eos=True)))
    eos = free.output_ids[3]
    engine.eos_token_ids = {eos}  # a token this prompt is known to produce
    stopped = engine.generate(Req(1, [3, 1, 4, 1, 5], SP(max_new_tokens=10)))
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop", "an EOS id finishes the request"
    ignored = engine.generate(Req(2, [3, 1, 4, 1, 5], SP(max_new_tokens=10, ignore_eos=True)))
    assert ignored.output_ids == free.output_ids and ignored.finish_reason == "length"
