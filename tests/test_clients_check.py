"""common.clients_check, rehearsed without its large tools: the whole command against tiny-llama,
with langchain-openai, litellm, guidellm, aiperf and lm-eval made unimportable. The openai-SDK rows
must pass, the structured-output rows must pass (or be cut off by max_tokens), and every missing
tool must give SKIP naming what to install; the server must be gone afterwards."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import httpx
import pytest

pytest.importorskip("openai")

from common import clients_check  # noqa: E402

MISSING = ("langchain_openai", "litellm", "guidellm", "aiperf", "lm_eval")  # the `clients` extra's
STRUCTURED = (
    "response_format json_schema",
    "response_format json_object",
    "chat.completions.parse(response_format=pydantic model)",
    "tool_choice naming a function",
)


@pytest.fixture(scope="module")
def run(tiny_llama_path, tmp_path_factory):
    """One `python -m common.clients_check --model <tiny-llama> --json ...`, in this process."""
    out = tmp_path_factory.mktemp("clients") / "rows.json"
    with pytest.MonkeyPatch.context() as mp:
        for module in MISSING:
            mp.setitem(sys.modules, module, None)  # `import module` now fails as if not installed
        printed = io.StringIO()  # capsys is per test; this output is shared by the module's tests
        with contextlib.redirect_stdout(printed):
            status = clients_check.main(["--model", str(tiny_llama_path), "--json", str(out)])
    return status, printed.getvalue(), [clients_check.Row(**r) for r in json.loads(out.read_text())]


def by_client(rows, client):
    return [r for r in rows if r.client == client]


def test_openai_rows_pass(run):
    _, printed, rows = run
    plain = [r for r in by_client(rows, "openai") if r.what not in STRUCTURED]
    assert len(plain) == 6
    assert all(r.result == "PASS" for r in plain), printed


def test_structured_rows_pass_or_say_why(run):
    """The server constrains these requests; a random tiny model may still be cut off by max_tokens
    before its JSON closes. Anything else (a 400, a 500, a client-side crash) is a defect."""
    _, printed, rows = run
    structured = [r for r in by_client(rows, "openai") if r.what in STRUCTURED]
    assert [r.what for r in structured] == list(STRUCTURED)
    for r in structured:
        cut_off = "finish length" in r.notes or "LengthFinishReasonError" in r.notes
        assert r.result == "PASS" or (r.result == "FAIL" and cut_off), (r, printed)


def test_missing_tools_are_skipped_with_the_install_command(run):
    _, _, rows = run
    others = [r for r in rows if r.client != "openai"]
    assert {r.client for r in others} == {"langchain", "litellm", "guidellm", "aiperf", "lm-eval"}
    for r in others:
        assert (
            r.result == "SKIP"
            and "is not installed" in r.notes
            and clients_check.INSTALL_HINT in r.notes
        ), r


def test_table_exit_status_and_server_stopped(run):
    status, printed, rows = run
    assert status == (1 if any(r.result == "FAIL" for r in rows) else 0)
    table = printed[printed.index("| client | what was run |") :]
    assert all(f"| {r.client} | {r.what} | {r.result} |" in table for r in rows)
    url = next(line.split()[-1] for line in printed.splitlines() if line.startswith("server at "))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_unknown_client_is_refused(capsys):
    with pytest.raises(SystemExit):
        clients_check.main(["--only", "openai,nosuch"])
    assert "unknown client(s) ['nosuch']" in capsys.readouterr().err
