"""Answers a worker sends after its headers: a non-streamed answer over ``max_response_bytes`` is a 502, and a
worker whose answers always break after the headers trips its circuit breaker (mock transport, real HTTP between
the client and the gateway on loopback)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from router.fleet import CircuitState
from router.transport import MockResponse, MockTransport, UpstreamRequest
from tests.router.harness import GatewayHarness, make_config
from tests.router.mock_workers import MockWorker

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

_ANSWER = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}).encode()


def _transport(chunks_of: dict[str, list[bytes | BaseException]],
               headers_of: dict[str, dict[str, str]]) -> MockTransport:
    async def handle(request: UpstreamRequest) -> MockResponse:
        if request.method == "GET":
            return MockResponse(200, {"Content-Type": "application/json"}, [b'{"ok": true}'])
        return MockResponse(200, headers_of[request.worker_id], list(chunks_of[request.worker_id]))

    return MockTransport(handle)


@asynccontextmanager
async def _started(ids: Sequence[str]) -> AsyncIterator[list[MockWorker]]:
    workers = [MockWorker(i) for i in ids]
    for w in workers:
        await w.start()
    try:
        yield workers
    finally:
        for w in workers:
            await w.stop()


@pytest.mark.parametrize("has_length", [True, False])
async def test_a_non_streamed_answer_over_max_response_bytes_is_a_502(has_length: bool) -> None:
    async with _started(["w0"]) as workers:
        body = b'{"x": "' + b"a" * 100 + b'"}'  # 109 bytes
        headers = {"Content-Type": "application/json"} | ({"Content-Length": str(len(body))} if has_length else {})
        transport = _transport({"w0": [body[:50], body[50:]]}, {"w0": headers})
        for cap, expected in [(109, 200), (108, 502)]:
            config = make_config(workers, max_response_bytes=cap)
            async with GatewayHarness(config, workers=workers, transport=transport) as h:
                status, _, answer = await h.post("/v1/completions", {"model": "m", "prompt": "hi"})
                assert status == expected
                if expected == 200:
                    assert answer == body
                else:
                    error = json.loads(answer)["error"]
                    assert error["type"] == "upstream_error"
                    assert error["message"].startswith(
                        "the worker's answer is over the gateway's max_response_bytes (108): ")
                    w0 = h.gw.fleet.workers["w0"]
                    assert (w0.num_inflight_requests, w0.breaker.num_consecutive_failures) == (0, 0)
        assert transport.responses[-1].is_released


@pytest.mark.parametrize("is_stream", [False, True])
async def test_a_worker_that_fails_after_its_headers_trips_its_circuit(is_stream: bool) -> None:
    async with _started(["w0", "w1"]) as workers:
        broken: list[bytes | BaseException] = [b"data: {}\n\n" if is_stream else _ANSWER[:10], ConnectionResetError()]
        kind = "text/event-stream" if is_stream else "application/json"
        transport = _transport({"w0": broken, "w1": [_ANSWER]}, {"w0": {"Content-Type": kind},
                                                                "w1": {"Content-Type": "application/json"}})
        config = make_config(workers, policy={"name": "round_robin"},
                             circuit_breaker={"failure_threshold": 3, "open_s": 3600})
        async with GatewayHarness(config, workers=workers, transport=transport) as h:
            w0 = h.gw.fleet.workers["w0"]
            assert h.session is not None
            for i in range(3):
                async with h.session.post(h.url + "/v1/completions",
                                          json={"model": "m", "prompt": "hi", "stream": is_stream},
                                          headers={"x-kvgate-worker": "w0"}) as r:
                    status = r.status
                    answer = await r.read()
                # A stream cut after its first chunk ends with an OpenAI error event (router.sse).
                assert status == (200 if is_stream else 502)
                if is_stream:
                    assert answer.startswith(b'data: {}\n\ndata: {"error":{"message":"the worker\'s answer broke')
                    assert answer.endswith(b'"code":"upstream_error"}}\n\ndata: [DONE]\n\n')
                assert w0.breaker.num_consecutive_failures == i + 1
            assert w0.breaker.state is CircuitState.OPEN
            # an open circuit takes no more requests: the next one goes to w1
            status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hi"})
            assert (status, headers["x-kvgate-worker"]) == (200, "w1")
            assert h.gw.fleet.workers["w1"].breaker.num_consecutive_failures == 0
