"""The answer ``/admin/decisions`` gives each aggregated decision (``DecisionRing.settle``): fake workers over real
HTTP on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

from router.decisions import DecisionRing
from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, make_config, wait_until

PROMPT = "x" * 8


async def answers(h: GatewayHarness) -> list[tuple[str, Any]]:
    """Newest first: each decision's request id and answer."""
    _, body = await h.admin("GET", "/admin/decisions?limit=10")
    return [(d["request_id"], d["answer"]) for d in body["decisions"]]


async def test_a_request_id_sent_again_has_no_answer_until_its_own_decision_settles(
        workers: list[FakeWorker]) -> None:
    """A client's ``x-request-id`` is kept end to end, so two requests may share one: while the second is in
    flight its decision shows no answer (not the first request's), and its own once it settles."""
    w0 = workers[0]
    async with GatewayHarness(make_config(workers[:1]), workers=workers[:1]) as h:
        status, _, _ = await h.post("/v1/completions", {"model": "m", "prompt": PROMPT},
                                    headers={"x-request-id": "same"})
        assert status == 200
        w0.answer_release = asyncio.Event()
        second = asyncio.create_task(h.post("/v1/completions", {"model": "m", "prompt": PROMPT, "stream": True},
                                            headers={"x-request-id": "same"}))
        await wait_until(lambda: len(h.gw.router.recent) == 2)
        assert await answers(h) == [("same", None), ("same", None)]
        w0.answer_release.set()
        assert (await second)[0] == 200
        want = {"served_by": "w0", "reported_cached_tokens": 4, "outcome": "ok"}
        assert await answers(h) == [("same", want), ("same", want)]


def test_an_answer_settled_again_is_the_newest_and_outlives_older_ones() -> None:
    ring = DecisionRing(2)
    ring.settle("r0", "w0", 0, "ok")
    ring.settle("r1", "w0", 0, "ok")
    ring.settle("r0", "w1", 4, "ok")  # r0 again (a client's id sent twice): now the newest
    ring.settle("r2", "w1", 8, "ok")
    assert ring.answer("r1") is None
    assert ring.answer("r0") == {"served_by": "w1", "reported_cached_tokens": 4, "outcome": "ok"}
    assert ring.answer("r2") == {"served_by": "w1", "reported_cached_tokens": 8, "outcome": "ok"}
