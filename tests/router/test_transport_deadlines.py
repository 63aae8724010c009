"""The real transport's first-byte timeout (``AiohttpTransport`` over loopback, ``FirstByteDeadlines``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from router.config import TimeoutsConfig
from router.errors import TransportTimeoutError
from router.transport import AiohttpTransport, FirstByteDeadlines, UpstreamRequest


async def _slow_server(delays_s: dict[str, float]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        await asyncio.sleep(delays_s[request.match_info["name"]])
        return web.Response(body=b'{"ok":true}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/{name}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


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
    deadlines = FirstByteDeadlines(loop, 0.05)
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
