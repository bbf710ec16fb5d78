"""Stage 8's bug-hunt checks beyond tests/exercises/stage8.py: structured outputs that finish, and
server processes that leave on SIGTERM."""

from __future__ import annotations

import json

STAGE = "stage8_server"
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                     "age": {"type": "integer"}},
                     "required": ["name", "age"]})
PROMPTS = ["Give me a person as JSON:", "Hi", "JSON please", "a b c"]


def test_json_schema_answers_finish_and_parse(stage):
    from common.models import resolve_model

    llm = stage.LLM(str(resolve_model("tiny-qwen3")), verbose=False)
    params = stage.SamplingParams(max_new_tokens=96, temperature=0.0, json_schema=SCHEMA)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.finish_reason == "stop", (
            f"{prompt!r} ran to max_new_tokens=96 ({out.finish_reason}): {out.text[:60]!r}...")
        answer = json.loads(out.text)  # a complete object, nothing after it
        assert set(answer) == {"name", "age"}, out.text


def test_the_detokenizer_worker_leaves_on_sigterm(stage):
    """The launcher stops the server with SIGTERM to each child: the child must exit by itself
    (status 0), not wait for the SIGKILL that follows 5 s later."""
    from common.bug_probes import sigterm_detokenizer

    alive, status = sigterm_detokenizer(stage, 20)
    assert not alive, "the detokenizer worker is still running 20 s after SIGTERM"
    assert status == 0, f"exit status {status}"
