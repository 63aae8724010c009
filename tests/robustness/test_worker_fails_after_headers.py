"""A worker that answers ``200`` with its headers and then drops the connection (an engine dying in prefill): the
client gets a stream that ends with an OpenAI error event and ``data: [DONE]``, as vLLM ends a stream that fails
(``router.sse``), never a stream that just stops; the request is settled as a failed one (found by
``benchmarks.chaos``)."""

from __future__ import annotations

import json
import re

import aiohttp
import openai
import pytest
from aiohttp import web

from router.fleet import CircuitState
from tests.ports import free_port
from tests.router.harness import LoopbackGateway, config_with_overrides
from workers.config import build_config
from workers.faults import Faults
from workers.server import build_app, build_worker

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

ERROR_EVENT = re.compile(
    rb'data: \{"error":\{"message":"the worker\'s answer broke after its headers: (?P<detail>(?:[^"\\]|\\.)+)",'
    rb'"type":"upstream_error","param":null,"code":"upstream_error"\}\}\n\ndata: \[DONE\]\n\n')
"""The bytes that end the client's stream (``router.sse.error_event``)."""


@pytest.fixture
async def failing_worker():
    config = build_config({"model": "m", "worker-id": "w-fail", "time-scale": 0.0, "enable-fault-injection": True,
                           "kv-cache": {"num-gpu-blocks": 64, "block-size": 4}})
    worker = build_worker(config)
    worker.faults = Faults(fail_after_headers=True)
    runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def gateway_config(url: str, **overrides):
    raw = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": 4}],
        # No events: the gateway indexes each routed request's blocks as approximate (pending) entries, which a
        # failed request must withdraw.
        "workers": [{"id": "w-fail", "url": url, "model": "m", "load_path": None, "snapshot_path": None}],
        "policy": {"name": "round_robin"},
        "admin": {"disable_auth": True},
        "health": {"interval_s": 3600},
        "circuit_breaker": {"failure_threshold": 2, "open_s": 3600},
    }
    return config_with_overrides(raw, overrides)


def stream_errors(metrics_text: str, worker_id: str) -> float:
    match = re.search(rf'^kvgate_stream_errors_total\{{worker="{worker_id}"\}} (\S+)$', metrics_text, re.M)
    assert match is not None, metrics_text
    return float(match.group(1))


async def test_a_stream_broken_after_the_headers_ends_with_an_openai_error(failing_worker):
    async with LoopbackGateway(gateway_config(failing_worker)) as gw, aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "hello world, hello world, hello", "max_tokens": 2, "stream": True}
        async with session.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()  # a clean end: no ClientPayloadError
        # The worker's comment event, relayed, then the error event and [DONE].
        assert raw.startswith(b": fault\n\n")
        assert ERROR_EVENT.fullmatch(raw[len(b": fault\n\n"):]) is not None, raw
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"}

        # Settled as a failed request: nothing in flight, pending or admitted; the circuit counted it; the routed
        # request's pending index entries withdrawn; the stream counted.
        worker = gw.gw.fleet.workers["w-fail"]
        assert (worker.num_inflight_requests, worker.num_pending_prefill_tokens, worker.num_decoding_requests) == (
            0, 0, 0)
        assert gw.gw.admission.num_inflight == 0
        assert worker.breaker.num_consecutive_failures == 1
        assert gw.gw.indexes["m"].stats().num_approx_blocks == 0
        metrics = await (await session.get(gw.url + "/metrics")).text()
        assert stream_errors(metrics, "w-fail") == 1.0
        assert 'kvgate_requests_total{policy="round_robin",status="200",worker="w-fail"} 1.0' in metrics


async def test_the_openai_client_raises_an_api_error_and_the_circuit_opens(failing_worker):
    async with LoopbackGateway(gateway_config(failing_worker)) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        try:
            for kind in ("completions", "chat"):  # failure_threshold: 2
                if kind == "completions":
                    stream = await client.completions.create(model="m", prompt="hello world", stream=True,
                                                             max_tokens=2)
                else:
                    stream = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=2)
                with pytest.raises(openai.APIError) as caught:
                    async for _chunk in stream:
                        pass
                # A clean error event, not a cut connection (APIConnectionError is an APIError too).
                assert not isinstance(caught.value, openai.APIConnectionError)
                assert caught.value.message.startswith("the worker's answer broke after its headers: ")
                assert caught.value.body == {"message": caught.value.message, "type": "upstream_error",
                                             "param": None, "code": "upstream_error"}
        finally:
            await client.close()
        worker = gw.gw.fleet.workers["w-fail"]
        assert worker.breaker.state == CircuitState.OPEN
        assert gw.gw.fleet.workers["w-fail"].num_inflight_requests == 0
        assert gw.gw.admission.num_inflight == 0
