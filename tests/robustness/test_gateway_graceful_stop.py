"""A gateway stopped gracefully (SIGTERM: ``router.serve``'s runner cleaned up) while it relays a stream: the stream
either finishes within ``listen.shutdown_grace_s`` or ends with an OpenAI error event and ``data: [DONE]``
(``router.drain``), never cut mid-body. Cut, its client saw a chunked body end without its last chunk
(``aiohttp.ClientPayloadError: TransferEncodingError: Not enough data to satisfy transfer length header``), as
``benchmarks.chaos`` found when it restarted a replica during a long prompt's stream.

The worker here sends its stream's first event, then waits for the test: the stop lands at a known point of the
stream, after the client holds the first event."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys

import aiohttp
import pytest
from aiohttp import web

from router.app import build_app
from router.gateway import GATEWAY
from router.serve import gateway_runner, serve
from tests.ports import free_port
from tests.router.harness import config_with_overrides

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

FIRST_EVENT = b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
LAST_EVENTS = b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"b"}]}\n\ndata: [DONE]\n\n'
BODY = {"model": "m", "prompt": "hello world, hello world, hello", "max_tokens": 2, "stream": True}


class StallingWorker:
    """A worker whose completion stream sends ``FIRST_EVENT``, then waits for ``release`` to send the rest."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_started = 0
        self.has_started = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(FIRST_EVENT)
        self.num_started += 1
        self.has_started.set()
        await self.release.wait()
        await resp.write(LAST_EVENTS)
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def __aenter__(self) -> StallingWorker:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self.runner is not None
        await self.runner.cleanup()


def gateway_config(url: str, shutdown_grace_s: float, port: int = 0):
    return config_with_overrides({
        "listen": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": shutdown_grace_s},
        "models": [{"name": "m", "block_size": 4}],
        "workers": [{"id": "w", "url": url, "model": "m", "load_path": None, "snapshot_path": None}],
        "policy": {"name": "round_robin"},
        "admin": {"disable_auth": True},
        "health": {"interval_s": 3600},
    }, {})


async def served(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` on a loopback port with the runner ``router.serve`` uses."""
    runner = gateway_runner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_stream_still_relayed_after_the_grace_ends_with_an_error_event_not_a_cut():
    async with StallingWorker() as worker, aiohttp.ClientSession() as session:
        app = build_app(gateway_config(worker.url, shutdown_grace_s=0.2))
        runner, url = await served(app)
        gw = app[GATEWAY]
        try:
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                assert await resp.content.readuntil(b"\n\n") == FIRST_EVENT
                assert gw.drain.num_streams == 1
                stop = asyncio.create_task(runner.cleanup())  # SIGTERM's path in router.serve
                rest = await resp.read()  # the worker never sends more: the drain ends the stream
            await stop
        finally:
            await runner.cleanup()
    events = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) == 2, rest
    assert json.loads(events[0]) == {"error": {
        "message": "the gateway stopped before the answer's end", "type": "service_unavailable", "param": None,
        "code": "gateway_stopping"}}
    # Settled as a failed request, not as the worker's failure; nothing left in flight.
    w = gw.fleet.workers["w"]
    assert (w.num_inflight_requests, w.num_pending_prefill_tokens, w.num_decoding_requests) == (0, 0, 0)
    assert w.breaker.num_consecutive_failures == 0
    assert gw.admission.num_inflight == 0 and gw.drain.num_streams == 0
    assert gw.indexes["m"].stats().num_approx_blocks == 0


async def test_a_stream_that_ends_within_the_grace_is_relayed_whole():
    async with StallingWorker() as worker, aiohttp.ClientSession() as session:
        app = build_app(gateway_config(worker.url, shutdown_grace_s=60.0))
        runner, url = await served(app)
        gw = app[GATEWAY]
        try:
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                assert await resp.content.readuntil(b"\n\n") == FIRST_EVENT
                stop = asyncio.create_task(runner.cleanup())
                while runner.sites:  # the listener closes first; the drain then waits for this stream
                    await asyncio.sleep(0.01)
                assert not stop.done()
                worker.release.set()
                rest = await resp.read()
            await stop  # over as soon as the stream is: well before the grace
        finally:
            await runner.cleanup()
    assert rest == LAST_EVENTS
    assert gw.fleet.workers["w"].breaker.num_consecutive_failures == 0
    assert gw.admission.num_inflight == 0 and gw.drain.num_streams == 0


async def test_sigterm_to_serve_ends_a_stream_still_relayed_with_an_error_event():
    """The same through ``router.serve.serve`` and a real SIGTERM (what a replica's restart sends)."""
    switch_interval_s = sys.getswitchinterval()
    port = free_port()
    async with StallingWorker() as worker, aiohttp.ClientSession() as session:
        server = asyncio.create_task(serve(gateway_config(worker.url, shutdown_grace_s=0.2, port=port)))
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    async with session.get(url + "/health") as probe:
                        if probe.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                assert await resp.content.readuntil(b"\n\n") == FIRST_EVENT
                os.kill(os.getpid(), signal.SIGTERM)  # serve's handler: a graceful stop
                rest = await resp.read()
            await server
        finally:
            server.cancel()
            sys.setswitchinterval(switch_interval_s)  # serve tunes its process: undone for the tests after
            gc.unfreeze()
    assert rest.endswith(b'"code":"gateway_stopping"}}\n\ndata: [DONE]\n\n'), rest
