"""Stage 8's exercises: the incremental detokenizer, holding back stop strings, the detokenizer
worker, the SSE chunks of an OpenAI stream.

Run them with `python -m common.exercises check 8` (your copy) or `check 8 --reference`.
"""

from __future__ import annotations

import json

import pytest

STAGE = "stage8_server"
TEXT = "Hello, 世界! naïve café 🙂 done."  # 世 and 界 take 2 and 3 byte-level tokens each


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_path))  # SmolLM2's byte-level BPE


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.task("8.incremental_detokenizer")
def test_text_grows_by_whole_characters_only(stage, tok):
    ids = ids_of(tok, TEXT)
    d = stage.detokenizer.IncrementalDetokenizer(tok)
    for i, token in enumerate(ids):
        assert d.add(token) is None
        assert "\ufffd" not in d.text, f"half a character after token {i}"
        so_far = tok.decode(ids[: i + 1])
        if not so_far.endswith("\ufffd"):
            assert d.text == so_far, "every complete character is in the text at once"
    assert d.text == TEXT


@pytest.mark.task("8.incremental_detokenizer")
def test_a_stop_string_across_tokens_is_found_and_trimmed(stage, tok):
    ids = ids_of(tok, TEXT)
    d = stage.detokenizer.IncrementalDetokenizer(tok, ["界!", "zzz"])
    found = [d.add(t) for t in ids[:9]]  # up to "!": the scheduler stops the request there
    assert found == [None] * 8 + ["界!"], "界 takes three tokens and ! a fourth: it spans them"
    assert d.text == "Hello, 世", "the stop string is not part of the output"
    assert d.matched_stop == "界!"
    d2 = stage.detokenizer.IncrementalDetokenizer(tok, ["llo, 世"])  # starts in text decoded earlier
    assert [d2.add(t) for t in ids[:5]] == [None] * 4 + ["llo, 世"] and d2.text == "He"


def stream(stage, tok, text, stops):
    d = stage.detokenizer.IncrementalDetokenizer(tok, stops)
    deltas = []
    for token in ids_of(tok, text):
        matched = d.add(token)
        deltas.append(d.take_delta(final=matched is not None))
        if matched is not None:
            break
    else:
        deltas.append(d.take_delta(final=True))
    return d, deltas


@pytest.mark.task("8.stop_hold_back")
def test_a_possible_stop_string_is_held_back(stage, tok):
    _, deltas = stream(stage, tok, "The cat says STOP now", ["STOP"])
    assert "".join(deltas) == "The cat says "
    assert not any("S" in x for x in deltas), "'ST' could be the start of STOP: never streamed"
    _, deltas = stream(stage, tok, "The cat says STOP now", ["STOPPED"])
    assert "".join(deltas) == "The cat says STOP now", "held back, released when it cannot stop"
    assert deltas[3] == " " and deltas[4] == "", "' ST', then ' STOP', could still become STOPPED"


@pytest.mark.task("8.stop_hold_back")
def test_held_back_counts_the_longest_stop_prefix_at_the_end(stage, tok):
    d = stage.detokenizer.IncrementalDetokenizer(tok, ["STOP", "<end>"])
    cases = [("abc ST", 2), ("abc STO", 3), ("abc", 0), ("abc <en", 3), ("abc STOPX", 0), ("S", 1)]
    for text, n in cases:
        d.text = text
        assert d._held_back() == n, text


@pytest.mark.task("8.stop_hold_back")
def test_the_final_delta_flushes_a_cut_character(stage, tok):
    d = stage.detokenizer.IncrementalDetokenizer(tok)
    for token in ids_of(tok, TEXT)[:4]:  # "Hello, " and the first of 世's two tokens
        d.add(token)
    assert d.take_delta() == "Hello, "
    assert d.take_delta() == "", "nothing twice"
    assert d.take_delta(final=True) == "\ufffd", "it ended inside a character: show what there is"


def outputs(stage, tok, rid, text, steps, stops=None):
    """The scheduler's outputs of one request: its tokens in `steps` chunks, the last finished."""
    ReqOutput, ids = stage.server.messages.ReqOutput, ids_of(tok, text)
    cuts = [round(i * len(ids) / steps) for i in range(steps + 1)]
    outs = [ReqOutput(rid, ids[a:b]) for a, b in zip(cuts, cuts[1:])]
    outs[0].stop_strings = stops
    outs[-1].finished, outs[-1].finish_reason = True, "length"
    return outs


@pytest.mark.task("8.detokenizer_worker")
def test_worker_keeps_one_decoding_state_per_request(stage, tok):
    worker = stage.server.detokenizer_worker.DetokenizerWorker(tok)
    a = outputs(stage, tok, 1, TEXT, 5)
    b = outputs(stage, tok, 2, "The cat says STOP", 3, stops=["STOP"])
    texts = {1: "", 2: ""}
    for step in range(5):  # both requests' steps arrive interleaved, in batches
        batch = [outs[step] for outs in (a, b) if step < len(outs)]
        for out in worker.handle(stage.server.messages.BatchTokenIDOut(batch)).outputs:
            texts[out.rid] += out.text
    assert texts == {1: TEXT, 2: "The cat says "}
    assert worker.states == {}, "a finished request's state is freed"


@pytest.mark.task("8.detokenizer_worker")
def test_worker_frees_an_aborted_request_and_names_logprob_tokens(stage, tok):
    msgs = stage.server.messages
    worker = stage.server.detokenizer_worker.DetokenizerWorker(tok)
    first = outputs(stage, tok, 7, TEXT, 3)[0]
    first.logprobs = [msgs.TokenLogprob(t, -0.5, [(t, -0.5), (30, -2.0)]) for t in first.token_ids]
    out = worker.detokenize(first)
    assert out.text and 7 in worker.states
    assert [lp.text for lp in out.logprobs] == [tok.decode([t]) for t in first.token_ids]
    assert out.logprobs[0].top_texts == [tok.decode([first.token_ids[0]]), "."]
    aborted = worker.detokenize(msgs.ReqOutput(7, [], finished=True, finish_reason="abort"))
    assert aborted.finish_reason == "abort" and 7 not in worker.states


def chat_stream(stage, builder, outs, index=0):
    return [chunk for out in outs for chunk in builder.stream_chunks(index, out)]


@pytest.mark.task("8.sse_chunks")
def test_chat_stream_opens_with_the_role_and_ends_with_the_reason(stage):
    from openai.types.chat import ChatCompletionChunk

    msgs = stage.server.messages
    builder = stage.server.openai_serving.ChatBuilder("tiny", num_choices=1, include_usage=True)
    outs = [msgs.ReqOutput(0, [5], text="Hel", prompt_tokens=4), msgs.ReqOutput(0, [6], text="lo"),
            msgs.ReqOutput(0, [7], text="", finished=True, finish_reason="stop", matched_stop=7)]
    chunks = chat_stream(stage, builder, outs) + builder.final_chunks()
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]  # the openai client's schema
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[0].choices[0].delta.content == ""
    assert [p.choices[0].delta.role for p in parsed[1:] if p.choices] == [None] * 3
    assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "Hello"
    assert [p.choices[0].finish_reason for p in parsed if p.choices] == [None, None, None, "stop"]
    assert chunks[3]["choices"][0]["matched_stop"] == 7 and chunks[3]["choices"][0]["delta"] == {}
    assert len({p.id for p in parsed}) == 1 and parsed[-1].usage.completion_tokens == 3
    event = stage.server.api_server.sse(chunks[1])
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:]) == chunks[1]


@pytest.mark.task("8.sse_chunks")
def test_chat_stream_numbers_its_choices_and_streams_logprobs(stage):
    msgs = stage.server.messages
    builder = stage.server.openai_serving.ChatBuilder("tiny", num_choices=2, n=2, logprobs=True)
    lp = msgs.TokenLogprob(5, -0.25, [(5, -0.25)], text="Hi", top_texts=["Hi"])
    first = chat_stream(stage, builder, [msgs.ReqOutput(0, [5], text="", logprobs=[lp])], index=1)
    assert [c["choices"][0]["index"] for c in first] == [1, 1]
    assert first[1]["choices"][0]["delta"] == {"content": ""}, "logprobs asked: it still streams"
    assert first[1]["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25
    empty = msgs.ReqOutput(0, [6], text="")
    assert chat_stream(stage, builder, [empty], index=1) == [], "nothing to send"
