"""The real transport's first-byte and total timeouts (``AiohttpTransport`` over loopback, ``Deadlines``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from router.config import TimeoutsConfig
from router.errors import TransportError, TransportTimeoutError
from router.transport import AiohttpTransport, Deadlines, UpstreamRequest


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on a free loopback port: ``(runner, base URL)``."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _slow_server(delays_s: dict[str, float]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        await asyncio.sleep(delays_s[request.match_info["name"]])
        return web.Response(body=b'{"ok":true}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/{name}", handle)
    return await _serve(app)


async def test_first_byte_timeout_cancels_only_the_late_request() -> None:
    runner, url = await _slow_server({"slow": 5.0, "fast": 0.0, "late-fast": 0.05})
    transport = AiohttpTransport(TimeoutsConfig(connect_s=1.0, first_byte_s=0.3, total_s=10.0))
    try:
        async def send(name: str) -> tuple[str, float]:
            t0 = time.monotonic()
            try:
                resp = await transport.send(UpstreamRequest("w0", url, "POST", f"/{name}", [], b"{}"))
            except TransportTimeoutError as exc:
                assert exc.is_before_first_byte and exc.worker_id == "w0"
                return "timeout", time.monotonic() - t0
            body = await resp.read()
            resp.release()
            assert body == b'{"ok":true}'
            return "ok", time.monotonic() - t0

        async def later(name: str, delay_s: float) -> tuple[str, float]:
            await asyncio.sleep(delay_s)
            return await send(name)

        results = await asyncio.gather(send("slow"), send("fast"), later("late-fast", 0.2), later("slow", 0.1))
        assert [r[0] for r in results] == ["timeout", "ok", "ok", "timeout"]
        assert 0.3 <= results[0][1] < 1.5  # the deadline, not the server's 5 s
        assert 0.3 <= results[3][1] < 1.5  # its own deadline, 0.1 s after the first one's
        # A request after the timeouts is served: its deadline is armed afresh.
        assert (await send("fast"))[0] == "ok"
        deadlines = transport._deadlines
        assert deadlines is not None and len(deadlines) <= 1  # finished entries were dropped
    finally:
        await transport.aclose()
        await runner.cleanup()


async def test_deadlines_fire_in_order_and_skip_finished_entries() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, 0.05)
    waiting = [asyncio.create_task(asyncio.sleep(10)) for _ in range(3)]
    entries = [deadlines.add(task) for task in waiting]  # type: ignore[arg-type]
    entries[1].is_done = True  # its headers arrived: never cancelled
    await asyncio.sleep(0.2)
    assert [e.has_fired for e in entries] == [True, False, True]
    assert [t.cancelled() for t in waiting] == [True, False, True]
    assert len(deadlines) == 0
    waiting[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting[1]


async def _stalling_server(stall_s: float) -> tuple[web.AppRunner, str]:
    """``/stream``: headers and one chunk, then a stall; ``/body``: a length-framed body whose second half comes
    after a stall; ``/quick``: a whole answer at once."""
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(stall_s)
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    async def body(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 8
        await resp.prepare(request)
        await resp.write(b"abcd")
        await asyncio.sleep(stall_s)
        await resp.write(b"efgh")
        await resp.write_eof()
        return resp

    async def quick(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/body", body)
    app.router.add_post("/quick", quick)
    return await _serve(app)


async def test_total_timeout_ends_a_stalled_body_after_the_first_byte() -> None:
    runner, url = await _stalling_server(5.0)
    transport = AiohttpTransport(TimeoutsConfig(connect_s=1.0, first_byte_s=0.3, total_s=0.6))
    try:
        t0 = time.monotonic()
        resp = await transport.send(UpstreamRequest("w0", url, "POST", "/stream", [], b"{}"))
        chunks = []
        with pytest.raises(TransportTimeoutError) as caught:
            async for chunk in resp.iter_chunks():
                chunks.append(chunk)
        resp.release()
        assert chunks == [b"data: 1\n\n"]
        assert not caught.value.is_before_first_byte and caught.value.worker_id == "w0"
        assert 0.6 <= time.monotonic() - t0 < 2.0  # the total deadline, not the server's 5 s stall
        assert isinstance(caught.value, TransportError)

        t0 = time.monotonic()
        resp = await transport.send(UpstreamRequest("w0", url, "POST", "/body", [], b"{}"))
        with pytest.raises(TransportTimeoutError) as caught:
            await resp.read()
        resp.release()
        assert not caught.value.is_before_first_byte
        assert 0.6 <= time.monotonic() - t0 < 2.0

        # An exchange that ended is never cancelled later: the task outlives its total deadline untouched.
        resp = await transport.send(UpstreamRequest("w0", url, "POST", "/quick", [], b"{}"))
        assert await resp.read() == b"ok"
        resp.release()
        await asyncio.sleep(0.8)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
    finally:
        await transport.aclose()
        await runner.cleanup()


async def test_deadline_fifo_is_compacted_behind_a_long_request() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, 60.0)
    long_running = asyncio.create_task(asyncio.sleep(10))
    head = deadlines.add(long_running)  # type: ignore[arg-type]
    live = []
    for i in range(3 * Deadlines.MIN_COMPACT_LEN):
        entry = deadlines.add(long_running)  # type: ignore[arg-type]
        if i % 100 == 0:
            live.append(entry)  # still running
        else:
            entry.is_done = True  # finished behind the head, which is still running
    # Without compaction the FIFO would hold every entry since the head; compacted, it holds the live ones plus
    # fewer than MIN_COMPACT_LEN finished since the last compaction.
    assert len(deadlines) < len(live) + 1 + Deadlines.MIN_COMPACT_LEN
    assert not head.is_done and not any(e.is_done for e in live)
    assert [e for e in deadlines._pending if not e.is_done] == [head, *live]  # order kept
    long_running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long_running
