"""Every way a request can end leaves the workers' counters, the admission slots and the index as they should be.

The gateway runs on a loopback port (real aiohttp server and client); its workers are a ``MockTransport``, so each
exit (answered, streamed, every attempt failed, retried on another worker, client gone before or after the first
byte) is set up exactly, with no socket to a worker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from router.errors import TransportConnectError
from router.gateway import Gateway
from router.transport import MockResponse, MockTransport, UpstreamRequest
from tests.router.harness import LoopbackGateway, config_with_overrides, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

Answer = Callable[[UpstreamRequest], Awaitable[MockResponse]]
PROMPT = "exits " * 6  # 36 byte-level tokens: 9 blocks of 4


def _usage(cached: int) -> dict[str, object]:
    return {"prompt_tokens": 36, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}


async def _ok(request: UpstreamRequest) -> MockResponse:
    body = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}], "usage": _usage(0)}
    return MockResponse(200, {"Content-Type": "application/json"}, [json.dumps(body).encode()])


async def _refused(request: UpstreamRequest) -> MockResponse:
    raise TransportConnectError(f"worker {request.worker_id} unreachable: ClientConnectorError",
                                worker_id=request.worker_id, endpoint=request.base_url, is_before_first_byte=True)


class MockFleet:
    """Two workers ``w0``, ``w1`` answered in memory: each request to a worker takes its next scripted answer
    (``_ok`` once the script is empty), after the answers in ``first``, which go to the first requests sent,
    whichever worker they go to; health checks answer 200."""

    def __init__(self) -> None:
        self.first: list[Answer] = []
        self.scripts: dict[str, list[Answer]] = {"w0": [], "w1": []}
        self.transport = MockTransport(self._handle)
        self.num_sent: dict[str, int] = {"w0": 0, "w1": 0}

    async def _handle(self, request: UpstreamRequest) -> MockResponse:
        if request.method == "GET":
            return MockResponse(200, {}, [b'{"ok": true}'])
        self.num_sent[request.worker_id] += 1
        script = self.first or self.scripts[request.worker_id]
        return await (script.pop(0) if script else _ok)(request)


def _config(**overrides: object) -> object:
    raw: dict[str, object] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": 4}],
        "workers": [{"id": w, "url": f"http://127.0.0.1:{9 + i}", "model": "m", "load_path": None,
                     "snapshot_path": None} for i, w in enumerate(("w0", "w1"))],
        "policy": {"name": "cache_aware"},
        "admin": {"token": "t"},
        "health": {"interval_s": 3600},
        "retry": {"max_retries": 1, "backoff_initial_s": 0.0},
    }
    return config_with_overrides(raw, dict(overrides))


def _counters(gw: Gateway) -> dict[str, tuple[int, int, int, int]]:
    return {w.worker_id: (w.num_inflight_requests, w.num_pending_prefill_tokens, w.num_inflight_prompt_tokens,
                          w.num_decoding_requests) for w in gw.fleet.workers.values()}


def _is_idle(gw: Gateway) -> bool:
    return (gw.admission.num_inflight == 0 and all(c == (0, 0, 0, 0) for c in _counters(gw).values())
            and all(gw.metrics.worker(w).num_inflight == 0 for w in gw.fleet.workers))


def _indexed(gw: Gateway) -> dict[str, int]:
    """Blocks held per worker (workers holding none left out)."""
    held = {w: sum(media.values()) for w, media in gw.indexes["m"].stats().num_blocks_by_worker.items()}
    return {w: n for w, n in held.items() if n}


async def _post(g: LoopbackGateway, body: dict[str, object], headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], bytes]:
    assert g.session is not None
    async with g.session.post(g.url + "/v1/completions", json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def test_answered_and_streamed_requests_release_everything() -> None:
    fleet = MockFleet()
    async with LoopbackGateway(_config(), transport=fleet.transport) as g:
        status, headers, _ = await _post(g, {"model": "m", "prompt": PROMPT}, {"x-kvgate-worker": "w0"})
        assert (status, headers["x-kvgate-worker"]) == (200, "w0") and _is_idle(g.gw)
        chunks = [b'data: {"choices": [{"text": "a"}]}\n\n',
                  b'data: {"choices": [], "usage": ' + json.dumps(_usage(32)).encode() + b"}\n\ndata: [DONE]\n\n"]

        async def stream(request: UpstreamRequest) -> MockResponse:
            return MockResponse(200, {"Content-Type": "text/event-stream"}, chunks)

        fleet.scripts["w0"].append(stream)
        status, _, raw = await _post(g, {"model": "m", "prompt": PROMPT, "stream": True}, {"x-kvgate-worker": "w0"})
        assert (status, raw) == (200, b"".join(chunks)) and _is_idle(g.gw)
        # Approximate mode (no events): the worker that served holds the prompt's 9 blocks.
        assert _indexed(g.gw) == {"w0": 9}
        sent = zip(fleet.transport.requests, fleet.transport.responses, strict=True)
        assert [r.is_released for q, r in sent if q.method == "POST"] == [True, True]


async def test_every_attempt_failing_releases_everything_and_withdraws_the_pending_blocks() -> None:
    fleet = MockFleet()
    async with LoopbackGateway(_config(), transport=fleet.transport) as g:
        fleet.scripts["w0"].append(_refused)
        fleet.scripts["w1"].append(_refused)
        status, _, body = await _post(g, {"model": "m", "prompt": PROMPT})
        assert status == 502 and json.loads(body)["error"]["message"].startswith("every attempt failed: worker w")
        assert fleet.num_sent == {"w0": 1, "w1": 1}
        assert _is_idle(g.gw) and _indexed(g.gw) == {}


async def test_a_retry_on_another_worker_releases_both_and_moves_the_blocks() -> None:
    fleet = MockFleet()
    async with LoopbackGateway(_config(), transport=fleet.transport) as g:
        fleet.first.append(_refused)  # the chosen worker refuses the connection
        status, headers, _ = await _post(g, {"model": "m", "prompt": PROMPT})
        chosen = g.gw.router.recent[-1].worker_id
        served = headers["x-kvgate-worker"]
        assert (status, headers["x-kvgate-decision"], {chosen, served}) == (200, "retry", {"w0", "w1"})
        assert fleet.num_sent == {"w0": 1, "w1": 1}
        assert _is_idle(g.gw) and _indexed(g.gw) == {served: 9}


@pytest.mark.parametrize("is_stream", [False, True])
async def test_a_client_gone_before_the_first_byte_releases_everything_and_withdraws(is_stream: bool) -> None:
    fleet = MockFleet()
    held = asyncio.Event()
    entered = asyncio.Event()

    async def hold(request: UpstreamRequest) -> MockResponse:
        entered.set()
        await held.wait()
        return await _ok(request)

    fleet.scripts["w0"].append(hold)
    async with LoopbackGateway(_config(), transport=fleet.transport) as g:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(g.url + "/v1/completions", headers={"x-kvgate-worker": "w0"},
                                              json={"model": "m", "prompt": PROMPT, "stream": is_stream}))
            await asyncio.wait_for(entered.wait(), 5)
            assert _counters(g.gw)["w0"] == (1, 36, 36, 0) and _indexed(g.gw) == {"w0": 9}
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await wait_until(lambda: _is_idle(g.gw))
        assert _indexed(g.gw) == {}


async def test_a_client_gone_mid_stream_releases_everything_and_keeps_the_blocks() -> None:
    fleet = MockFleet()
    never = asyncio.Event()

    async def stream(request: UpstreamRequest) -> MockResponse:
        return MockResponse(200, {"Content-Type": "text/event-stream"},
                            [b'data: {"choices": [{"text": "a"}]}\n\n', never])

    fleet.scripts["w0"].append(stream)
    async with LoopbackGateway(_config(), transport=fleet.transport) as g:
        async with aiohttp.ClientSession() as s:
            r = await s.post(g.url + "/v1/completions", headers={"x-kvgate-worker": "w0"},
                             json={"model": "m", "prompt": PROMPT, "stream": True})
            assert await r.content.readline() == b'data: {"choices": [{"text": "a"}]}\n'
            assert _counters(g.gw)["w0"] == (1, 0, 36, 1)
            r.close()
        await wait_until(lambda: _is_idle(g.gw))
        assert _indexed(g.gw) == {"w0": 9}  # the worker served it: it holds the prompt
        assert fleet.transport.responses[-1].is_released
