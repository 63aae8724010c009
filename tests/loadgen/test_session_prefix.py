"""Per-run session prefixes: every session id loadgen sends and records carries the run's prefix.

A gateway keeps session -> worker ownership for an idle timeout, so a second run with the same bare ids (``s0``,
``syn0``, ``trace_0003/agent_001``) would inherit the first run's placements. The runs below go to a fake OpenAI
server on 127.0.0.1 that records the headers it receives.
"""

import asyncio
import json
import re

import msgspec
import pytest

from loadgen.errors import ReplayError
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig, Replayer, new_session_prefix
from router.cli import main as kvgate

from .builders import AGENTIC_TRACE, BUNDLED_TRACE, make_request
from .fake_openai import FakeOpenAI, serve_fake

pytestmark = pytest.mark.integration

RANDOM_PREFIX = re.compile(r"lg-[0-9a-f]{8}-")

SYNTHETIC = [
    "--synthetic", "--syn-num-sessions", "2", "--syn-num-turns", "2", "--syn-think-time-s", "0.1",
    "--syn-system-prompt-tokens", "128", "--syn-tool-output-tokens", "64", "--syn-output-tokens", "4",
]  # fmt: skip
"""Two synthetic sessions of two turns: ``syn0``, ``syn1``."""
SYNTHETIC_IDS = ["syn0", "syn0", "syn1", "syn1"]
"""What one closed-loop runner sends for ``SYNTHETIC``: each session's turns in order, sessions in order."""
SYNTHETIC_TRACE_ORDER_IDS = ["syn0", "syn1", "syn0", "syn1"]
"""The same requests in trace (arrival) order, the order of ``records.jsonl``."""


async def run_loadgen(url, workload, *extra, out=None):
    """Run ``kvgate loadgen`` closed loop with one runner (a fixed order of requests) against ``url``."""
    argv = [
        "loadgen", *workload, "--url", url, "--mode", "closed", "--concurrency", "1", "--time-scale", "50",
        "--max-output-tokens", "2", "--no-progress", "--no-plots", *extra,
    ]  # fmt: skip
    if out is not None:
        argv += ["--out", str(out)]
    return await asyncio.to_thread(kvgate, argv)


def recorded_session_ids(out):
    """The session ids of ``records.jsonl`` (trace order)."""
    return [json.loads(line)["session_id"] for line in (out / "records.jsonl").read_text().splitlines()]


AGENTIC_IDS = ["trace_0003", "trace_0003/agent_001", "trace_0003/agent_002"]


@pytest.mark.parametrize(
    ("workload", "sent_ids", "trace_order_ids"),
    [
        (SYNTHETIC, SYNTHETIC_IDS, SYNTHETIC_TRACE_ORDER_IDS),
        (["--trace", BUNDLED_TRACE, "--max-requests", "4"], ["s0", "s1", "s2", "s3"], ["s0", "s1", "s2", "s3"]),
        (["--trace", AGENTIC_TRACE, "--max-requests-per-session", "1"], AGENTIC_IDS, AGENTIC_IDS),
    ],
    ids=["synthetic", "mooncake", "agentic"],
)
async def test_explicit_prefix_is_on_every_session_id_sent_and_recorded(
    tmp_path, capsys, workload, sent_ids, trace_order_ids
):
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        rc = await run_loadgen(url, workload, "--session-prefix", "cmp-b-", out=tmp_path)
    assert rc == 0
    assert fake.session_ids == ["cmp-b-" + session_id for session_id in sent_ids]
    assert recorded_session_ids(tmp_path) == ["cmp-b-" + session_id for session_id in trace_order_ids]
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["session_prefix"] == "cmp-b-"
    assert "session ids prefixed with 'cmp-b-'" in capsys.readouterr().out.splitlines()


async def test_two_default_runs_use_different_random_prefixes(tmp_path, capsys):
    prefixes = []
    for n in range(2):
        fake = FakeOpenAI()
        out = tmp_path / f"run{n}"
        async with serve_fake(fake) as url:
            assert await run_loadgen(url, SYNTHETIC, out=out) == 0
        prefix = json.loads((out / "results.json").read_text())["runs"][0]["session_prefix"]
        assert RANDOM_PREFIX.fullmatch(prefix), prefix
        assert fake.session_ids == [prefix + session_id for session_id in SYNTHETIC_IDS]
        assert recorded_session_ids(out) == [prefix + session_id for session_id in SYNTHETIC_TRACE_ORDER_IDS]
        assert f"session ids prefixed with '{prefix}'" in capsys.readouterr().out.splitlines()
        prefixes.append(prefix)
    assert prefixes[0] != prefixes[1]


async def test_empty_prefix_sends_the_bare_ids(tmp_path, capsys):
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        rc = await run_loadgen(url, SYNTHETIC, "--session-prefix", "", out=tmp_path)
    assert rc == 0
    assert fake.session_ids == SYNTHETIC_IDS
    assert recorded_session_ids(tmp_path) == SYNTHETIC_TRACE_ORDER_IDS
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["session_prefix"] == ""
    assert "session ids sent without a prefix (--session-prefix '')" in capsys.readouterr().out.splitlines()


async def test_prefix_goes_in_the_header_named_by_session_header(tmp_path):
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        rc = await run_loadgen(
            url, SYNTHETIC, "--session-header", "x-smg-routing-key", "--session-prefix", "p7-", out=tmp_path
        )
    assert rc == 0
    assert [h.get("x-smg-routing-key") for h in fake.headers] == ["p7-syn0", "p7-syn0", "p7-syn1", "p7-syn1"]
    assert [h.get("x-session-id") for h in fake.headers] == [None] * 4
    assert all("user" not in body for body in fake.bodies)  # loadgen names the session in the header only
    assert recorded_session_ids(tmp_path) == ["p7-syn0", "p7-syn1", "p7-syn0", "p7-syn1"]


async def test_replayer_prefixes_ids_and_sends_no_header_without_a_session():
    requests = [
        make_request([0], 64, block_size=64, session_id="a", out=2),
        make_request([1], 64, block_size=64, session_id="", out=2),
        make_request([0, 2], 128, block_size=64, session_id="a", out=2),
    ]
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        config = ReplayConfig(url=url, mode="closed", concurrency=1, session_prefix="r1-")
        result = await Replayer(requests, config, PromptBuilder()).run()
    # closed loop: session "a" (both turns), then the session-less request
    assert fake.session_ids == ["r1-a", "r1-a", None]
    assert [r.session_id for r in result.records] == ["r1-a", "", "r1-a"]


def test_bad_prefixes_are_refused(capsys):
    with pytest.raises(SystemExit) as exc_info:
        kvgate(["loadgen", "--synthetic", "--url", "http://127.0.0.1:1", "--session-prefix", "a b"])
    assert exc_info.value.code == 2
    assert (
        "session prefix must be at most 64 visible ASCII characters (no spaces), got 'a b'" in capsys.readouterr().err
    )
    requests = [make_request([0], 64, block_size=64, session_id="a")]
    for bad in ("line\nbreak", "é-", "x" * 65):
        with pytest.raises(ReplayError, match="session prefix"):
            Replayer(requests, ReplayConfig(url="http://127.0.0.1:1", session_prefix=bad), PromptBuilder())
        with pytest.raises(msgspec.ValidationError, match="session-prefix"):
            msgspec.convert({"url": "http://127.0.0.1:1", "session-prefix": bad}, ReplayConfig)
    assert msgspec.convert({"url": "http://h:1", "session-prefix": "x" * 64}, ReplayConfig).session_prefix == "x" * 64


def test_new_session_prefix_is_short_random_hex():
    prefixes = {new_session_prefix() for _ in range(64)}
    assert all(RANDOM_PREFIX.fullmatch(p) for p in prefixes)
    assert len(prefixes) == 64
