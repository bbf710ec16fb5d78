"""Stage 5: a step's index lists cross to the device in two copies (engine.to_device), not eight.

On a GPU each `torch.tensor(list, device="cuda")` is a blocking copy from pageable memory; prepare
packs the int64 lists (input ids, positions, KV slots, last-token rows) into one host buffer and the
int32 lists (page-table rows, prefix and sequence lengths, cu_seqlens) into another, each copied
once (pinned and without waiting on CUDA). Checked on a CPU: the values are the lists', each
field a view of its group's one buffer, two copies a step, and the tokens unchanged (the golden
tests run the same prepare).
"""

from __future__ import annotations

import torch

import stage5_cudagraph.engine as engine_module
from stage5_cudagraph import LLM, SamplingParams
from stage5_cudagraph.engine import to_device


def test_to_device_gives_views_of_one_buffer_with_the_lists_values():
    lists = [[3, 1, 4], [], [1, 5], [9]]
    parts = to_device(lists, torch.int32, torch.device("cpu"))
    assert [p.tolist() for p in parts] == lists
    assert all(p.dtype == torch.int32 and p.is_contiguous() for p in parts)
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1


def test_a_step_makes_two_copies_and_the_fields_are_the_lists(tiny_llama_path, monkeypatch):
    calls, batches = [], []
    real = engine_module.to_device
    monkeypatch.setattr(engine_module, "to_device",
                        lambda lists, dtype, dev: calls.append((len(lists), dtype)) or real(lists, dtype, dev))
    with LLM(tiny_llama_path, verbose=False) as llm:
        prepare = llm.engine.prepare

        def watched(batch):  # the lists as they are when the step is prepared
            calls.clear()
            fb = prepare(batch)
            expected = {"out_cache_loc": list(batch.out_cache_loc),
                        "seq_lens": [r.device_len for r in batch.reqs],
                        "prefix_lens": [r.cached_len for r in batch.reqs],
                        "req_rows": [r.table_idx for r in batch.reqs]}
            batches.append((list(calls), expected, fb))
            return fb

        llm.engine.prepare = watched
        llm.generate(["Hello there", "A longer prompt, to batch with the first"],
                     SamplingParams(max_new_tokens=3, temperature=0.0))
    assert batches
    for calls_of_step, expected, fb in batches:
        assert calls_of_step == [(4, torch.long), (4, torch.int32)]
        for name, values in expected.items():
            assert getattr(fb, name).tolist() == values, name
        lens = torch.tensor(fb.seq_lens.tolist()) - torch.tensor(fb.prefix_lens.tolist())
        assert fb.cu_seqlens.tolist() == [0, *torch.cumsum(lens, 0).tolist()]
        assert fb.last_token_indices.tolist() == [n - 1 for n in fb.cu_seqlens.tolist()[1:]]
        assert fb.input_ids.dtype == fb.positions.dtype == torch.long
