"""Stage 4's bug-hunt checks beyond tests/exercises/stage4.py."""

from __future__ import annotations

STAGE = "stage4_scheduler"
TEXT = "Hello, 世界! naïve café 🙂 done."  # 世 and 界 take 2 and 3 byte-level tokens each


def test_aborted_requests_give_every_page_back(stage, tiny_llama_path):
    llm = stage.LLM(str(tiny_llama_path), attention_backend="torch", max_total_tokens=512,
                    verbose=False)
    params = stage.SamplingParams(max_new_tokens=30, ignore_eos=True)
    stream = llm.stream([[3, 1, 4, 1, 5, 9], [5, 6, 7, 8]], params)
    for i, _chunk in enumerate(stream):
        if i == 5:
            break
    stream.close()  # the consumer left: both requests are aborted
    assert llm.scheduler.cache.num_used_pages == 0, "an aborted request's pages go back"
    llm.scheduler.check_integrity()
    done = llm.generate([[3, 1, 4]], stage.SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(done[0].token_ids) == 3 and llm.scheduler.cache.num_used_pages == 0


def test_streamed_text_never_holds_half_a_character(stage, tiny_llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = stage.detokenizer.IncrementalDetokenizer(tok)
    for i, token in enumerate(ids):
        d.add(token)
        assert "\ufffd" not in d.text, f"half a character after token {i}"
    assert d.text == TEXT == tok.decode(ids)
