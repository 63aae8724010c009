"""``max_duration_s``: every wait of a replay ends at the deadline and nothing is sent after it.

The traces below wait 60 s (a think time, an arrival) or hold a slot 2 s, against a 1 s deadline; each replay must
end right after the deadline (or after its one request in flight), far below those waits.
"""

import asyncio
import json
import time

import msgspec
import pytest

from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig, Replayer
from router.cli import main as kvgate

from .builders import AGENTIC_TRACE, make_request
from .fake_openai import FakeOpenAI, serve_fake

pytestmark = pytest.mark.integration

DEADLINE_S = 1.0
"""The replays' ``max_duration_s``: wide enough that a loaded machine still sends the first request before it."""
MAX_WALL_S = 5.0
"""A replay bounded by ``DEADLINE_S`` ends well within this; an unbounded 60 s wait would not."""
TABLE_HEADER = (
    "| run | ok | failed | not sent | hit ratio | of ceiling | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | "
    "ITL p50 (ms) | ITL p99 (ms) | out tok/s | imbalance (tokens) | imbalance (requests) | cached mismatch |"
)


def two_sessions_with_long_think_times():
    return [
        make_request([0, 1], 128, block_size=64, arrival_s=0.0, session_id="a", out=2),
        make_request([2, 3], 128, block_size=64, arrival_s=0.0, session_id="b", out=2),
        make_request([0, 1, 4], 192, block_size=64, arrival_s=61.0, session_id="a", out=2, think=60.0),
        make_request([2, 3, 5], 192, block_size=64, arrival_s=61.0, session_id="b", out=2, think=60.0),
    ]


async def timed_replay(requests, config, fake):
    async with serve_fake(fake) as url:
        t0 = time.perf_counter()
        result = await Replayer(requests, msgspec.structs.replace(config, url=url), PromptBuilder()).run()
        return result, time.perf_counter() - t0


@pytest.mark.parametrize(("concurrency", "sent"), [(1, [0]), (2, [0, 1])])
async def test_closed_loop_think_time_ends_at_the_deadline(concurrency, sent):
    fake = FakeOpenAI()
    config = ReplayConfig(url="http://127.0.0.1:1", mode="closed", concurrency=concurrency, max_duration_s=DEADLINE_S)
    result, wall_s = await timed_replay(two_sessions_with_long_think_times(), config, fake)
    # each runner sends its session's first turn, then its 60 s think time is cut at the deadline
    assert [r.index for r in result.records] == sent
    assert [r.error_kind for r in result.records] == [None] * len(sent)
    assert result.num_skipped == 4 - len(sent)
    assert len(fake.bodies) == len(sent)
    assert DEADLINE_S - 0.05 <= result.duration_s <= wall_s < MAX_WALL_S


async def test_open_loop_arrival_wait_ends_at_the_deadline():
    requests = [
        make_request([0], 64, block_size=64, arrival_s=0.0, session_id="a", out=2),
        make_request([0, 1], 128, block_size=64, arrival_s=60.0, session_id="a", out=2),
        make_request([0, 1, 2], 192, block_size=64, arrival_s=120.0, session_id="a", out=2),
    ]
    fake = FakeOpenAI()
    config = ReplayConfig(url="http://127.0.0.1:1", max_duration_s=DEADLINE_S)
    result, wall_s = await timed_replay(requests, config, fake)
    assert [r.index for r in result.records] == [0]
    assert result.num_skipped == 2
    assert len(fake.bodies) == 1
    assert DEADLINE_S - 0.05 <= result.duration_s <= wall_s < MAX_WALL_S


async def test_open_loop_slot_freed_after_the_deadline_sends_nothing():
    # one slot; the first answer holds it 2 s, past the 1 s deadline: the two requests queued for it are not sent
    requests = [make_request([i], 64, block_size=64, arrival_s=0.0, session_id=f"s{i}", out=2) for i in range(3)]
    fake = FakeOpenAI(response_delay_s=2 * DEADLINE_S)
    config = ReplayConfig(url="http://127.0.0.1:1", max_in_flight=1, max_duration_s=DEADLINE_S)
    result, wall_s = await timed_replay(requests, config, fake)
    assert [r.index for r in result.records] == [0]
    assert [r.error_kind for r in result.records] == [None]  # the request in flight at the deadline finished
    assert result.num_skipped == 2
    assert len(fake.bodies) == 1
    assert 2 * DEADLINE_S - 0.05 <= result.duration_s <= wall_s < MAX_WALL_S


async def test_loadgen_cli_stops_a_145_s_think_time_at_the_deadline(tmp_path):
    # the reported command: the trace's second turn of trace_0003 waits a 145 s think time
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        argv = [
            "loadgen", "--trace", AGENTIC_TRACE, "--url", url, "--mode", "closed", "--concurrency", "1",
            "--max-requests-per-session", "2", "--max-duration-s", str(DEADLINE_S), "--max-output-tokens", "2",
            "--no-progress", "--no-plots", "--out", str(tmp_path), "--session-prefix", "d-",
        ]  # fmt: skip
        t0 = time.perf_counter()
        rc = await asyncio.to_thread(kvgate, argv)
        wall_s = time.perf_counter() - t0
    assert rc == 0
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    # 6 requests (3 sessions × 2 turns); the one runner sends trace_0003's first turn, then the deadline ends it
    assert (run["requests_ok"], run["requests_failed"], run["num_skipped"]) == (1, 0, 5)
    assert fake.session_ids == ["d-trace_0003"]
    assert wall_s < MAX_WALL_S


async def test_loadgen_console_shows_the_requests_not_sent(tmp_path, capsys):
    # 4 requests in 2 sessions with 60 s think times: the 1 s deadline leaves both second turns unsent
    trace = tmp_path / "two_sessions.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t_ms, "input_length": 512 * len(ids), "output_length": 2, "hash_ids": ids}) + "\n"
            for t_ms, ids in [(0, [0, 1]), (0, [2, 3]), (60_000, [0, 1, 4]), (60_000, [2, 3, 5])]
        )
    )
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        argv = [
            "loadgen", "--trace", str(trace), "--url", url, "--max-duration-s", str(DEADLINE_S), "--no-progress",
            "--no-plots", "--out", str(tmp_path / "out"), "--label", "cut",
        ]  # fmt: skip
        t0 = time.perf_counter()
        rc = await asyncio.to_thread(kvgate, argv)
        wall_s = time.perf_counter() - t0
    assert rc == 0
    assert wall_s < MAX_WALL_S
    run = json.loads((tmp_path / "out" / "results.json").read_text())["runs"][0]
    outcome = (run["requests_ok"], run["requests_failed"], run["num_skipped"], run["skip_reason"])
    assert outcome == (2, 0, 2, "max_duration_s")
    # the console, like results.json, accounts for all 4: the table's "not sent" column and the line with the reason
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("slice: 4 requests, 2 sessions, ")
    header = lines.index(TABLE_HEADER)
    assert lines[header + 2].startswith("| cut | 2 | 0 | 2 | ")
    not_sent = "cut: 4 requests, 2 ok, 0 failed, 2 not sent (max-duration-s reached)."
    assert not_sent in lines[header + 3 :]
    assert not_sent in (tmp_path / "out" / "results.md").read_text().splitlines()
