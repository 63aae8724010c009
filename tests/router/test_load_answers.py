"""A worker's load answer: a malformed one (out-of-range counts or usage) is ignored, logged once, and the last good
load kept, so one worker cannot break the cost model for its whole model."""

from __future__ import annotations

import logging

import pytest

from router.config import parse_config
from router.fleet import Fleet, WorkerLoad


class _Getter:
    def __init__(self, answers: list[object]) -> None:
        self.answers = answers

    async def get_json(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, object]:
        return 200, self.answers.pop(0)


@pytest.mark.parametrize("bad", [
    {"num_running_requests": 10**400},
    {"num_running_requests": -1},
    {"num_waiting_requests": 1_000_001},
    {"kv_usage": 1.5},
    {"kv_usage": -0.1},
])
async def test_malformed_load_answer_keeps_the_last_good_load(bad: dict[str, object], caplog) -> None:
    config = parse_config({
        "models": [{"name": "m", "block_size": 16}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "model": "m"}],
        "admin": {"disable_auth": True},
    })
    good = {"num_running_requests": 3, "num_waiting_requests": 1, "kv_usage": 0.5}
    getter = _Getter([good, bad, bad])
    fleet = Fleet(config, getter)
    fleet.add(config.workers[0])
    await fleet.poll_load_once()
    assert fleet.workers["w0"].load == WorkerLoad(3, 1, 0.5)
    with caplog.at_level(logging.WARNING, logger="router.fleet"):
        await fleet.poll_load_once()
        await fleet.poll_load_once()
    assert fleet.workers["w0"].load == WorkerLoad(3, 1, 0.5)
    warnings = [r.getMessage() for r in caplog.records if "malformed load answer" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("worker w0: malformed load answer ignored (")
