"""Run a gateway in-process on a loopback port in front of ``FakeWorker``s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import aiohttp
from aiohttp import web

from router.app import build_app
from router.config import GatewayConfig, parse_config
from router.gateway import GATEWAY, Gateway
from router.http_server import GatewayAppRunner
from router.transport import Transport
from tests.router.fakes import BLOCK_SIZE, FakeWorker

TOKEN = "test-token"


class Clock:
    """Injected monotonic clock."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def config_with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> GatewayConfig:
    """Parse ``raw`` with ``overrides``: a dict merges into the section of that name, anything else replaces it."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return parse_config(raw)


def make_config(workers: list[FakeWorker], **overrides: Any) -> GatewayConfig:
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": BLOCK_SIZE}],
        "workers": [
            {"id": w.worker_id, "url": w.url, "model": "m", "events_endpoint": w.events_endpoint,
             "load_path": None, "snapshot_path": None}
            for w in workers
        ],
        "policy": {"name": "cache_aware"},
        "admin": {"token": TOKEN},
        "health": {"interval_s": 3600},
        "retry": {"max_retries": 2, "backoff_initial_s": 0.0},
    }
    return config_with_overrides(raw, overrides)


class LoopbackGateway:
    """The gateway app on a loopback port, with a client session while entered."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic,
                 transport: Transport | None = None) -> None:
        self.app = build_app(config, clock=clock, transport=transport)
        self.runner = GatewayAppRunner(self.app, handler_cancellation=True)  # as ``router.serve`` runs it
        self.port = 0
        self.session: aiohttp.ClientSession | None = None

    @property
    def gw(self) -> Gateway:
        return self.app[GATEWAY]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Self:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()
        await self.runner.cleanup()


class GatewayHarness(LoopbackGateway):
    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic,
                 workers: Sequence[FakeWorker] | None = None, transport: Transport | None = None) -> None:
        self.workers = list(workers or [])
        super().__init__(config, clock, transport)

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        await self.connect_events(self.workers)
        return self

    async def connect_events(self, workers: Sequence[FakeWorker]) -> None:
        """Publish empty batches until the gateway's subscriber has seen one from each worker (ZMQ slow joiner)."""
        for w in workers:
            if w.publisher is None:
                continue
            async with asyncio.timeout(10):
                while self.gw.subscriber.last_seq(w.worker_id) is None:
                    w.publisher.publish([])
                    await asyncio.sleep(0.02)

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
                   raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        assert self.session is not None
        data = raw if raw is not None else None
        async with self.session.post(self.url + path, json=None if raw is not None else body, data=data,
                                     headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def admin(self, method: str, path: str, body: Any = None, token: str | None = TOKEN,
                    raw: bytes | None = None) -> tuple[int, Any]:
        assert self.session is not None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(method, self.url + path, json=body if raw is None else None, data=raw,
                                        headers=headers) as resp:
            return resp.status, await resp.json()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` on the loop until it holds (no timing assertion: fails only if it never holds)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def index_holds(gw: Gateway, worker_id: str, num_blocks: int) -> Callable[[], bool]:
    def check() -> bool:
        stats = gw.indexes["m"].stats()
        return sum(stats.num_blocks_by_worker.get(worker_id, {}).values()) >= num_blocks

    return check


def load_counters(gw: Gateway) -> dict[str, tuple[int, int, int, int]]:
    """Per worker: (requests in flight, pending prefill tokens, prompt tokens in flight, decoding requests)."""
    return {w.worker_id: (w.num_inflight_requests, w.num_pending_prefill_tokens, w.num_inflight_prompt_tokens,
                          w.num_decoding_requests) for w in gw.fleet.workers.values()}


def is_idle(gw: Gateway) -> bool:
    return (gw.admission.num_inflight == 0 and gw.admission.num_waiting == 0
            and all(c == (0, 0, 0, 0) for c in load_counters(gw).values()))
