"""Odd answers from a worker, written byte by byte on a raw loopback socket: what the client gets.

A redirect is relayed, never followed (following it would resend the completion or drop its body); a 1xx final
answer is a failure before the first byte (retried elsewhere, else a JSON 502); a header value with a control
character is dropped (aiohttp refuses to send it) while the rest of the answer is relayed; a 200 without usage is
counted as an unchecked prediction.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

_USAGE = b'{"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}'
_STREAM_BODY = b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n'
ANSWERS = {
    "redirect": b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n",
    "status_101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    "ctrl_in_header": (b"HTTP/1.1 200 OK\r\nX-Ctl: a\x01b\r\nX-Ok: yes\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(_USAGE) + _USAGE),
    "stream_without_usage": (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                             % len(_STREAM_BODY) + _STREAM_BODY),
}


class RawWorker:
    """A loopback HTTP/1.1 server answering every request with ``ANSWERS[self.answer]``, then closing."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.events_endpoint = None
        self.answer = "redirect"
        self.requests: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            line = head.split(b"\r\n", 1)[0]
            if line.startswith(b"POST"):  # the health checks' GETs are not counted
                self.requests.append(line)
            writer.write(ANSWERS[self.answer])
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def fleet():
    raw, fake = RawWorker("raw"), FakeWorker("w1")
    await raw.start()
    await fake.start()
    yield raw, fake
    await raw.stop()
    await fake.stop()


def _config(raw: RawWorker, fake: FakeWorker):  # type: ignore[no-untyped-def]
    return make_config([SimpleNamespace(worker_id=raw.worker_id, url=raw.url, events_endpoint=None), fake])


async def test_a_redirect_is_relayed_not_followed(fleet):
    raw, fake = fleet
    async with GatewayHarness(_config(raw, fake), workers=[fake]) as h:
        assert h.session is not None
        async with h.session.post(h.url + "/v1/completions", json={"model": "m", "prompt": "hello"},
                                  headers={"x-kvgate-worker": "raw"}, allow_redirects=False) as resp:
            status, location, body = resp.status, resp.headers["Location"], await resp.read()
    assert status == 307 and location == "/elsewhere" and body == b""
    assert raw.requests == [b"POST /v1/completions HTTP/1.1"]  # sent once, never to /elsewhere


async def test_a_1xx_answer_is_retried_elsewhere_or_a_json_502(fleet):
    raw, fake = fleet
    raw.answer = "status_101"
    async with GatewayHarness(_config(raw, fake), workers=[fake]) as h:
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": "hello"},
                                             headers={"x-kvgate-worker": "raw"})
        assert status == 502 and headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["error"]["message"] == "every attempt failed: worker answered 101"
        # Chosen by the policy (both idle, "raw" first in the config): the retry on w1 serves it.
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": "hello"})
        assert status == 200 and headers["x-kvgate-worker"] == "w1" and headers["x-kvgate-decision"] == "retry"
    assert raw.requests == [b"POST /v1/completions HTTP/1.1"] * 2 and len(fake.requests) == 1


async def test_a_control_character_in_a_worker_header_drops_that_header_only(fleet):
    raw, fake = fleet
    raw.answer = "ctrl_in_header"
    async with GatewayHarness(_config(raw, fake), workers=[fake]) as h:
        for stream in (False, True):
            status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": "hello",
                                                                     "stream": stream},
                                                 headers={"x-kvgate-worker": "raw"})
            assert status == 200 and body == _USAGE
            assert "X-Ctl" not in headers and headers["X-Ok"] == "yes" and headers["x-kvgate-worker"] == "raw"


async def test_a_stream_without_usage_counts_as_unchecked(fleet):
    raw, fake = fleet
    raw.answer = "stream_without_usage"
    async with GatewayHarness(_config(raw, fake), workers=[fake]) as h:
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": "hello", "stream": True},
                                       headers={"x-kvgate-worker": "raw"})
        assert status == 200 and body == _STREAM_BODY
        assert h.session is not None
        async with h.session.get(h.url + "/metrics") as resp:
            text = await resp.text()
    assert 'kvgate_cached_tokens_checks_total{result="unchecked",worker="raw"} 1.0' in text
    assert 'kvgate_cached_tokens_checks_total{result="match",worker="raw"} 0.0' in text
