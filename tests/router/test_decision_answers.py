"""The answer ``/admin/decisions`` gives each aggregated decision (``DecisionRing.settle``), the honesty counters of
a stream that ends without usage, and which error answers the gateway logs (``router.api._answer_error``): fake
workers over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest

from router.decisions import DecisionRing
from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, make_config, wait_until

PROMPT = "x" * 8


async def answers(h: GatewayHarness) -> list[tuple[str, Any]]:
    """Newest first: each decision's request id and answer."""
    _, body = await h.admin("GET", "/admin/decisions?limit=10")
    return [(d["request_id"], d["answer"]) for d in body["decisions"]]


def checks(h: GatewayHarness, worker_id: str) -> tuple[int, int, int, int, int]:
    """The worker's honesty checks (match, mismatch, unchecked), its mismatches of any cause, its stream errors."""
    m = h.gw.metrics.worker(worker_id)
    return (m.num_checks_match, m.num_checks_mismatch, m.num_checks_unchecked, sum(m.num_mismatches.values()),
            m.num_stream_errors)


def api_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "router.api"]


async def test_a_retried_request_is_answered_by_the_worker_that_served_it_and_relayed_errors_are_not_logged(
        workers: list[FakeWorker], caplog: pytest.LogCaptureFixture) -> None:
    """The chosen worker fails before its first byte, the other serves it: ``served_by`` is the other. Every attempt
    failing (each worker once) relays the last one's 500 (answered ``status_500`` by it), and neither that nor a
    client's 404 is logged by the gateway."""
    w0, w1 = workers
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        w0.fail_statuses = [500]  # w0 is chosen first (configuration order on an idle fleet)
        with caplog.at_level(logging.WARNING, logger="router.api"):
            status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PROMPT},
                                              headers={"x-request-id": "r-retry"})
            assert (status, headers["x-kvgate-decision"], headers["x-kvgate-worker"]) == (200, "retry", "w1")
            w0.fail_statuses, w1.fail_statuses = [500], [500]
            status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": "y" * 8},
                                           headers={"x-request-id": "r-fail"})
            assert (status, json.loads(body)) == (500, {"error": {"message": "boom"}})
            status, _, _ = await h.post("/v1/completions", {"model": "nope", "prompt": PROMPT},
                                        headers={"x-request-id": "r-404"})
            assert status == 404
        assert api_lines(caplog) == []
        assert await answers(h) == [
            ("r-fail", {"served_by": "w1", "reported_cached_tokens": None, "outcome": "status_500"}),
            ("r-retry", {"served_by": "w1", "reported_cached_tokens": 0, "outcome": "ok"}),
        ]
        assert (len(w0.requests), len(w1.requests), w0.fail_statuses, w1.fail_statuses) == (2, 2, [], [])
        assert checks(h, "w0") == (0, 0, 0, 0, 0) and checks(h, "w1") == (1, 0, 0, 0, 0)


async def test_a_stream_broken_or_left_before_its_usage_is_counted_once_as_unchecked(
        workers: list[FakeWorker]) -> None:
    """A worker that breaks its stream after the headers (no usage yet) and a client that leaves before the usage:
    each is one unchecked honesty check and no mismatch; the answers are ``UpstreamError`` and ``client_gone``, both
    served by the worker."""
    w0 = workers[0]
    async with GatewayHarness(make_config(workers[:1]), workers=workers[:1]) as h:
        w0.stream_cut = b'data: {"choices":[{"text":"t"}]}\n\n'
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": PROMPT, "stream": True},
                                       headers={"x-request-id": "r-cut"})
        assert status == 200 and body.startswith(b'data: {"choices":[{"text":"t"}]}\n\ndata: {"error":')
        assert body.endswith(b"data: [DONE]\n\n")
        w0.stream_cut = None
        assert checks(h, "w0") == (0, 0, 1, 0, 1)
        w0.stream_release = asyncio.Event()  # the worker holds its stream after the first chunk
        async with aiohttp.ClientSession() as s:
            resp = await s.post(h.url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "stream": True},
                                headers={"x-request-id": "r-gone"})
            assert (await resp.content.readline()).startswith(b"data: ")
            resp.close()
        await wait_until(lambda: h.gw.router.recent.answer("r-gone") is not None)
        w0.stream_release.set()
        await wait_until(lambda: w0.num_active == 0)
        assert checks(h, "w0") == (0, 0, 2, 0, 1)
        assert await answers(h) == [
            ("r-gone", {"served_by": "w0", "reported_cached_tokens": None, "outcome": "client_gone"}),
            ("r-cut", {"served_by": "w0", "reported_cached_tokens": None, "outcome": "UpstreamError"}),
        ]


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


async def test_a_refused_request_has_no_decision_and_every_attempt_failing_is_logged_once(
        workers: list[FakeWorker], caplog: pytest.LogCaptureFixture) -> None:
    """Admission's 429 (at capacity, no queue) makes no decision and is not logged; with both workers gone, every
    attempt fails: the gateway's own 502, logged once with the request id, answered by no worker."""
    w0, w1 = workers
    config = make_config(workers, admission={"max_inflight_requests": 1, "queue_size": 0})
    async with GatewayHarness(config, workers=workers) as h:
        w0.answer_release = asyncio.Event()
        with caplog.at_level(logging.WARNING, logger="router.api"):
            held = asyncio.create_task(h.post("/v1/completions", {"model": "m", "prompt": PROMPT, "stream": True},
                                              headers={"x-request-id": "r-held"}))
            await wait_until(lambda: w0.num_active == 1)
            status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": PROMPT},
                                                 headers={"x-request-id": "r-429"})
            assert (status, headers["Retry-After"], json.loads(body)["error"]["code"]) == (429, "1", "overloaded")
            w0.answer_release.set()
            assert (await held)[0] == 200
            await w0.stop()
            await w1.stop()
            status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": PROMPT},
                                           headers={"x-request-id": "r-dead"})
        message = "every attempt failed: worker w1 unreachable: ClientConnectorError"
        assert (status, json.loads(body)["error"]["message"]) == (502, message)
        assert api_lines(caplog) == [f"request r-dead answered 502 (UpstreamError): {message}"]
        assert await answers(h) == [
            ("r-dead", {"served_by": None, "reported_cached_tokens": None, "outcome": "UpstreamError"}),
            ("r-held", {"served_by": "w0", "reported_cached_tokens": 0, "outcome": "ok"}),
        ]
