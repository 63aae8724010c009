import json
import socket

import pytest

from loadgen.ceiling import ceiling
from loadgen.errors import ReplayError
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig, Replayer
from loadgen.runner import replay_with_progress, write_results

from .builders import make_request
from .fake_openai import FakeOpenAI, serve_fake

pytestmark = pytest.mark.integration


def chain_requests():
    return [
        make_request([0, 1], 100, block_size=64, arrival_s=0.0, session_id="a", out=3),
        make_request([0, 2], 100, block_size=64, arrival_s=0.0, session_id="b", out=3),
        make_request([0, 1, 3], 160, block_size=64, arrival_s=1.0, session_id="a", out=5, think=0.5),
        make_request([0, 2, 4], 180, block_size=64, arrival_s=1.0, session_id="b", out=2, think=0.5),
    ]


async def test_open_loop_replay_records_everything():
    fake = FakeOpenAI(worker_id="w7")
    async with serve_fake(fake) as url:
        config = ReplayConfig(url=url, time_scale=100.0, max_output_tokens=4)
        outcome = await replay_with_progress(chain_requests(), config, PromptBuilder(), label="t", show_progress=False)
    s, records = outcome.summary, outcome.records
    assert [r.error_kind for r in records] == [None] * 4
    assert [r.num_output_tokens for r in records] == [3, 3, 4, 2]
    assert sorted(b["max_tokens"] for b in fake.bodies) == [2, 3, 3, 4]  # 5 capped at 4
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert sorted(fake.session_ids) == ["a", "a", "b", "b"]
    assert [r.num_reported_prompt_tokens for r in records] == [100, 100, 160, 180]
    # request 2 extends request 0 by whole blocks: the fake's 16-token cache returns its 96 full-block tokens
    assert records[2].num_cached_tokens == 96 and records[3].num_cached_tokens == 96
    assert {r.worker for r in records} == {"w7"}
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s for r in records)
    assert len(records[2].itl_s) == 3
    assert s.requests_ok == 4 and s.cached_tokens_mismatch_ratio == 0.0
    assert s.ceiling_hit_ratio == pytest.approx((0 + 64 + 128 + 128) / 540)
    # the trace's second batch is sent 1 s / 100 after the first
    assert records[2].start_s >= 0.01


async def test_closed_loop_runs_sessions_in_order():
    fake = FakeOpenAI()
    async with serve_fake(fake) as url:
        config = ReplayConfig(url=url, mode="closed", concurrency=1, time_scale=1000.0)
        result = await Replayer(chain_requests(), config, PromptBuilder()).run()
    assert fake.session_ids == ["a", "a", "b", "b"]
    assert [r.index for r in result.records] == [0, 1, 2, 3]
    # the server's ids, in the order it answered (a's turns, then b's): each record keeps the id of its own answer
    assert [r.request_id for r in result.records] == ["fake-0-req-0", "fake-0-req-2", "fake-0-req-1", "fake-0-req-3"]
    assert result.records[2].start_s > result.records[0].start_s + result.records[0].e2e_s


async def test_errors_are_recorded_by_kind(tmp_path):
    fake = FakeOpenAI(predicted_offset=16)
    reqs = chain_requests()
    async with serve_fake(fake) as url:
        config = ReplayConfig(url=url, time_scale=1000.0)
        builder = PromptBuilder()

        class FailingPrompts(PromptBuilder):
            def prompt(self, request):
                text = builder.prompt(request)
                return "FAIL" + text[4:] if request.session_id == "b" else text

        outcome = await replay_with_progress(reqs, config, FailingPrompts(), label="f", show_progress=False)
    s = outcome.summary
    assert s.errors_by_kind == {"http_503": 2}
    assert (s.requests_ok, s.requests_failed) == (2, 2)
    assert s.cached_tokens_mismatch_ratio == 1.0  # the fake predicts 16 more than it reports
    paths = write_results(tmp_path, [outcome], extra={"note": "x"})
    names = sorted(p.name for p in paths)
    assert names == [
        "hit_ratio_over_time.png",
        "records.jsonl",
        "results.json",
        "results.md",
        "ttft_cdf.png",
        "worker_load_over_time.png",
    ]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["note"] == "x" and data["runs"][0]["requests_failed"] == 2
    assert (tmp_path / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 4


async def test_connection_refused_and_missing_usage():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = ReplayConfig(url=f"http://127.0.0.1:{port}", time_scale=1000.0)
    result = await Replayer(chain_requests()[:1], config, PromptBuilder()).run()
    assert result.records[0].error_kind == "connect"
    fake = FakeOpenAI(send_usage=False)
    async with serve_fake(fake) as url:
        result = await Replayer(chain_requests()[:1], ReplayConfig(url=url), PromptBuilder()).run()
    assert result.records[0].error_kind == "no_usage"
    assert result.records[0].num_output_tokens == 3


def test_bad_replay_input():
    with pytest.raises(ReplayError, match="empty"):
        Replayer([], ReplayConfig(url="http://127.0.0.1:1"), PromptBuilder())
    with pytest.raises(ReplayError, match="http"):
        Replayer(chain_requests(), ReplayConfig(url="127.0.0.1:1"), PromptBuilder())
    assert ReplayConfig(url="http://h:1/v1").completions_url == "http://h:1/v1/completions"
    assert ReplayConfig(url="http://h:1/").completions_url == "http://h:1/v1/completions"


async def test_failed_request_is_outside_both_hit_ratio_and_ceiling():
    # the worker refuses prompts over 256 tokens (http_400), as a sim worker refuses one its KV cache cannot hold
    reqs = [
        make_request([0, 1], 128, block_size=64, arrival_s=0.0, session_id="a", out=2),
        make_request([0, 1, 2], 192, block_size=64, arrival_s=1.0, session_id="a", out=2),  # cached 128
        make_request([3, 4, 5, 6, 7], 320, block_size=64, arrival_s=2.0, session_id="b", out=2),  # refused
        make_request([3, 4], 100, block_size=64, arrival_s=3.0, session_id="b", out=2),  # nothing cached
        make_request([0, 1], 120, block_size=64, arrival_s=4.0, session_id="c", out=2),  # cached 112 of 120
    ]
    fake = FakeOpenAI(max_prompt_tokens=256)
    async with serve_fake(fake) as url:
        config = ReplayConfig(url=url, mode="closed", concurrency=1, time_scale=1000.0)
        outcome = await replay_with_progress(reqs, config, PromptBuilder(), label="f", show_progress=False)
    s = outcome.summary
    assert s.errors_by_kind == {"http_400": 1}
    assert (s.requests_ok, s.requests_failed) == (4, 1)
    assert [r.num_cached_tokens for r in outcome.records] == [0, 128, None, 0, 112]
    # hit ratio and ceiling over the same 4 requests (540 prompt tokens): the ceiling reuses 0 + 128 + 0 + 120
    assert (s.num_prompt_tokens, s.num_cached_tokens) == (540, 240)
    assert s.hit_ratio == 240 / 540
    assert s.ceiling_hit_ratio == 248 / 540
    assert s.fraction_of_ceiling == (240 / 540) / (248 / 540)
    assert s.fraction_of_ceiling <= 1.0
    # the whole slice's ceiling counts the refused prompt (and [3, 4] reusing it): 348 of 860, below the hit ratio
    assert ceiling(reqs).hit_ratio == 348 / 860 < s.hit_ratio
