import json

import pytest

from router.cli import main as kvgate

from .fake_openai import FakeOpenAI, serve_fake

pytestmark = pytest.mark.integration


def test_loadgen_bad_trace_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert kvgate(["loadgen", "--trace", str(bad), "--url", "http://127.0.0.1:1", "--no-progress"]) == 2
    assert "missing field 'input_length'" in capsys.readouterr().out


async def test_loadgen_synthetic_closed_loop_writes_results(tmp_path):
    import asyncio

    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        argv = [
            "loadgen", "--synthetic", "--syn-num-sessions", "3", "--syn-num-turns", "3", "--syn-think-time-s", "0.1",
            "--syn-system-prompt-tokens", "128", "--syn-tool-output-tokens", "64", "--syn-output-tokens", "4",
            "--url", url, "--mode", "closed", "--concurrency", "2", "--time-scale", "50", "--no-progress",
            "--out", str(tmp_path), "--label", "syn", "--session-prefix", "",
        ]  # fmt: skip
        rc = await asyncio.to_thread(kvgate, argv)
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    run = data["runs"][0]
    assert (run["policy"], run["requests_ok"], run["requests_failed"]) == ("syn", 9, 0)
    assert run["hit_ratio"] > 0.5  # every later turn extends the earlier one on the single fake worker
    assert sorted(set(fake.session_ids)) == ["syn0", "syn1", "syn2"]
    assert (tmp_path / "results.md").read_text().startswith("| run |")
    assert "Times in simulated seconds (wall seconds × time scale 50)." in (tmp_path / "results.md").read_text()
    # nothing failed, so the run served the whole slice: its ceiling is the slice's
    assert data["slice_ceiling"]["hit_ratio"] == run["ceiling_hit_ratio"]
    assert data["slice_ceiling"]["num_prompt_tokens"] == run["num_prompt_tokens"]


def test_loadgen_against_a_url_that_is_down_says_so(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        code = kvgate(["loadgen", "--synthetic", "--syn-num-sessions", "2", "--syn-num-turns", "1", "--url", url,
                       "--mode", "closed", "--max-duration-s", "20", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "Errors by kind: run: {'connect': 2}." in out
    assert f"no request reached {url}: is the gateway (or worker) up and listening there?" in out


def test_no_success_hint_names_the_model_on_404_and_stays_quiet_otherwise():
    from loadgen.cli import _no_success_hint

    hint = _no_success_hint(0, {"http_404": 3}, "http://h:1", "sim")
    assert hint == "every request got 404: does http://h:1 serve the model 'sim'? --model names it (default 'sim')"
    assert _no_success_hint(1, {"connect": 3}, "http://h:1", "m") is None
    assert _no_success_hint(0, {"connect": 1, "timeout": 1}, "http://h:1", "m") is None
    assert _no_success_hint(0, {"timeout": 2}, "http://h:1", "m") is None
