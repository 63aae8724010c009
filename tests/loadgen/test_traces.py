import json

import pytest

from loadgen.errors import TraceError
from loadgen.traces import (
    TraceRequest,
    detect_format,
    read_agentic_session,
    read_agentic_sessions,
    read_mooncake,
    spread_buckets,
)
from tests.loadgen.builders import AGENTIC_TRACE, BUNDLED_TRACE

pytestmark = pytest.mark.unit

LINES = [
    {"timestamp": 1000, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [0, 2]},
    {"timestamp": 4000, "input_length": 1536, "output_length": 30, "hash_ids": [0, 1, 3]},
    {"timestamp": 7000, "input_length": 512, "output_length": 40, "hash_ids": [0]},
]


def write_jsonl(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def test_mooncake_reads_fields_and_rebases_time(tmp_path):
    reqs = read_mooncake(write_jsonl(tmp_path, LINES))
    assert [r.arrival_s for r in reqs] == [0.0, 0.0, 3.0, 6.0]
    assert [r.num_prompt_tokens for r in reqs] == [1000, 600, 1536, 512]
    assert [r.num_output_tokens for r in reqs] == [10, 20, 30, 40]
    assert reqs[2].hash_ids == (0, 1, 3)
    assert all(r.block_size == 512 and r.session_id == "" for r in reqs)


def test_mooncake_slice_by_start_duration_and_cap(tmp_path):
    path = write_jsonl(tmp_path, LINES)
    reqs = read_mooncake(path, start_s=2.0, duration_s=5.0)
    assert [r.num_output_tokens for r in reqs] == [30, 40]
    assert [r.arrival_s for r in reqs] == [0.0, 3.0]
    assert [r.num_output_tokens for r in read_mooncake(path, max_requests=2)] == [10, 20]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [0]}), "missing field 'output_length'"),
        (json.dumps({"timestamp": 2000, "input_length": -1, "output_length": 1, "hash_ids": []}), "input_length"),
        (json.dumps({"timestamp": 2000, "input_length": 5000, "output_length": 1, "hash_ids": [1]}), "hash_ids"),
        (json.dumps({"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}), "hash_ids"),
    ],
)
def test_mooncake_bad_line_names_file_and_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path, [LINES[0], bad])
    with pytest.raises(TraceError, match=message) as info:
        read_mooncake(path)
    assert info.value.line_number == 2
    assert str(path) in str(info.value)


def test_mooncake_backwards_timestamps_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match="backwards"):
        read_mooncake(write_jsonl(tmp_path, [LINES[2], LINES[0]]))
    with pytest.raises(TraceError, match="cannot open"):
        read_mooncake(tmp_path / "missing.jsonl")


def test_real_conversation_trace_head():
    reqs = read_mooncake(BUNDLED_TRACE, max_requests=5)
    assert [r.num_prompt_tokens for r in reqs] == [6758, 7322, 7236, 2290, 6760]
    assert reqs[0].hash_ids == tuple(range(14))


SESSION = {
    "id": "trace_x",
    "block_size": 64,
    "hash_id_scope": "local",
    "requests": [
        {"t": 0.0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2, 3], "think_time": 0.0},
        {
            "t": 10.0,
            "type": "subagent",
            "agent_id": "agent_001",
            "requests": [
                {"t": 0.0, "type": "n", "in": 64, "out": 3, "hash_ids": [50], "think_time": 0.0},
                {"t": 4.5, "type": "n", "in": 128, "out": 3, "hash_ids": [50, 51], "think_time": 1.5},
            ],
        },
        {"t": 20.0, "type": "s", "in": 200, "out": 7, "hash_ids": [1, 2, 3, 4], "think_time": 2.0},
    ],
}


def test_agentic_session_with_subagent(tmp_path):
    path = tmp_path / "trace_x.json"
    path.write_text(json.dumps(SESSION))
    reqs = read_agentic_session(path)
    assert [(r.arrival_s, r.session_id) for r in reqs] == [
        (0.0, "trace_x"),
        (10.0, "trace_x/agent_001"),
        (14.5, "trace_x/agent_001"),
        (20.0, "trace_x"),
    ]
    assert {r.namespace for r in reqs} == {"trace_x"}
    assert [r.think_time_s for r in reqs] == [0.0, 0.0, 1.5, 2.0]
    assert all(r.block_size == 64 for r in reqs)
    other = dict(SESSION, id="trace_y")
    (tmp_path / "trace_y.json").write_text(json.dumps(other))
    merged = read_agentic_sessions([tmp_path], session_stagger_s=100.0, max_requests_per_session=1)
    assert [(r.arrival_s, r.session_id) for r in merged] == [
        (0.0, "trace_x"),
        (10.0, "trace_x/agent_001"),
        (100.0, "trace_y"),
        (110.0, "trace_y/agent_001"),
    ]


def test_agentic_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(TraceError, match="not JSON"):
        read_agentic_session(bad)
    bad.write_text(json.dumps({"requests": [{"t": 0, "in": 10, "hash_ids": [1]}]}))
    with pytest.raises(TraceError, match="missing field 'out'"):
        read_agentic_session(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="no session files"):
        read_agentic_sessions([empty])


def test_real_agentic_file_with_subagents():
    reqs = read_agentic_session(AGENTIC_TRACE)
    sessions = {r.session_id for r in reqs}
    assert "trace_0003" in sessions and any("/agent_" in s for s in sessions)
    assert all(len(r.hash_ids) >= 1 for r in reqs)


def test_detect_format(tmp_path):
    assert detect_format(write_jsonl(tmp_path, LINES)) == "mooncake"
    assert detect_format(tmp_path) == "agentic"
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(TraceError, match="unknown trace format"):
        detect_format(tmp_path / "a.csv")


@pytest.mark.unit
def test_spread_buckets_keeps_order_counts_and_rate():
    reqs = [TraceRequest(arrival_s=t, num_prompt_tokens=10, num_output_tokens=1, hash_ids=(0,), block_size=512)
            for t in (0.0, 0.0, 0.0, 3.0, 4.0, 4.0)]  # fmt: skip
    assert [r.arrival_s for r in spread_buckets(reqs)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.5]
    assert [r.arrival_s for r in spread_buckets(reqs, bucket_s=0.5)] == [0.0, 0.5 / 3, 1.0 / 3, 3.0, 4.0, 4.25]
    assert spread_buckets([]) == []
    with pytest.raises(ValueError, match="bucket_s"):
        spread_buckets(reqs, bucket_s=0.0)
