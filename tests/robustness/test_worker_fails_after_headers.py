"""A worker that answers ``200`` with its headers and then drops the connection (an engine dying in prefill):
the client gets a clean OpenAI-style error, never a stream that just stops (found by ``benchmarks.chaos``)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from tests.ports import free_port
from tests.router.harness import LoopbackGateway, config_with_overrides
from workers.config import build_config
from workers.faults import Faults
from workers.server import build_app, build_worker

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


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


def gateway_config(url: str):
    raw = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": 4}],
        "workers": [{"id": "w-fail", "url": url, "model": "m", "load_path": None, "snapshot_path": None}],
        "policy": {"name": "round_robin"},
        "admin": {"disable_auth": True},
        "health": {"interval_s": 3600},
    }
    return config_with_overrides(raw, {})


@pytest.mark.xfail(strict=True, reason="router/proxy.py's _relay_stream aborts the client connection when a worker "
                   "breaks its stream after the headers (chosen so that no client reads a truncated answer as "
                   "complete) instead of ending it with an OpenAI error event (vLLM's mid-stream error shape); the "
                   "change also changes what test_stream_break_after_first_byte_is_not_retried and the vLLM interop "
                   "test assert (a connection error), so it is left to the request-lifecycle owners")
async def test_a_stream_broken_after_the_headers_ends_with_an_openai_error(failing_worker):
    async with LoopbackGateway(gateway_config(failing_worker)) as gw, aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "hello world, hello", "max_tokens": 2, "stream": True}
        async with session.post(gw.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                answer = await resp.json()
                assert set(answer["error"]) >= {"message", "type"}
                return
            events = [line[5:].strip() for line in (await resp.read()).split(b"\n") if line.startswith(b"data:")]
        errors = [json.loads(e) for e in events if e != b"[DONE]" and "error" in json.loads(e)]
        assert errors and set(errors[-1]["error"]) >= {"message", "type"}
