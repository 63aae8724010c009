"""Real sim workers (``workers.server``) in-process on loopback ports, with real ZMQ publishers, and a gateway
in front of them.

A ``SimWorker`` is the reference worker exactly as ``kvgate worker --engine sim`` builds it (``build_worker`` +
``build_app``), run in the test's event loop: starting one takes milliseconds, and a restart keeps its HTTP and
ZMQ ports (a new process would: new start id, event seq from 0). ``time_scale=0`` runs the engine unpaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from events.publisher import KVEventPublisher, PublisherConfig
from router.config import GatewayConfig
from router.gateway import Gateway
from tests.ports import free_port
from tests.router.harness import LoopbackGateway, config_with_overrides
from workers.config import build_config
from workers.server import Worker, build_worker
from workers.server import build_app as build_worker_app

MODEL = "m"
BLOCK_SIZE = 16
TOKEN = "test-token"




class Clock:
    """Injected monotonic clock: real time plus a manual offset (the gateway's background loops still run)."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


class SimWorker:
    """One sim worker on 127.0.0.1.

    Args:
        worker_id: its id (also the gateway's id for it).
        num_gpu_blocks / num_cpu_blocks: KV pools (``num_cpu_blocks > 0`` enables the CPU tier).
        timing: ``TimingProfile`` keys (kebab-case) overriding the defaults.
        time_scale: wall seconds per simulated second (0: unpaced).
        with_events: publish KV events.
        with_replay: serve replays (a ROUTER endpoint).
        connect_to: publish by connecting to this endpoint (the gateway's bound SUB) with topic
            ``kv@<worker_id>@m``, instead of binding a PUB.
    """

    def __init__(
        self, worker_id: str, *, num_gpu_blocks: int = 512, num_cpu_blocks: int = 0,
        timing: dict[str, Any] | None = None, time_scale: float = 0.0, with_events: bool = True,
        with_replay: bool = True, connect_to: str | None = None, max_num_batched_tokens: int = 8192,
    ) -> None:
        self.worker_id = worker_id
        self.raw: dict[str, Any] = {
            "worker-id": worker_id,
            "model": MODEL,
            "time-scale": time_scale,
            "kv-cache": {"num-gpu-blocks": num_gpu_blocks, "num-cpu-blocks": num_cpu_blocks,
                         "block-size": BLOCK_SIZE},
            "scheduler": {"max-model-len": 65536, "max-num-batched-tokens": max_num_batched_tokens,
                          "default-max-tokens": 4},
            "timing": timing or {},
        }
        self.with_events = with_events
        self.with_replay = with_replay
        self.connect_to = connect_to
        self.port = free_port()
        self.pub_endpoint = "tcp://127.0.0.1:*"
        self.replay_endpoint_spec = "tcp://127.0.0.1:*"
        self.worker: Worker | None = None
        self.publisher: KVEventPublisher | None = None
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        if not self.with_events or self.connect_to is not None:
            return None
        return self.pub_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.replay_endpoint_spec if self.with_events and self.with_replay else None

    @property
    def core(self) -> Any:
        assert self.worker is not None
        return self.worker.core

    def gateway_entry(self, **extra: Any) -> dict[str, Any]:
        """This worker's entry in the gateway's ``workers`` list."""
        entry: dict[str, Any] = {"id": self.worker_id, "url": self.url, "model": MODEL,
                                 "events_endpoint": self.events_endpoint, "replay_endpoint": self.replay_endpoint}
        if self.connect_to is not None:
            entry["topology"] = "bind"
        entry.update(extra)
        return entry

    def _make_publisher(self) -> KVEventPublisher | None:
        if not self.with_events:
            return None
        if self.connect_to is not None:
            cfg = PublisherConfig(endpoint=self.connect_to, bind=False, topic=f"kv@{self.worker_id}@{MODEL}",
                                  linger_s=0.0)
            return KVEventPublisher(cfg)
        cfg = PublisherConfig(endpoint=self.pub_endpoint, bind=True, linger_s=0.0,
                              replay_endpoint=self.replay_endpoint_spec if self.with_replay else None)
        return KVEventPublisher(cfg)

    async def start(self) -> SimWorker:
        """Start (or start again after ``stop``: same ports, new start id, event seq from 0)."""
        deadline = time.monotonic() + 5.0
        while True:  # a just-closed port can take a moment to be bindable again
            try:
                self.publisher = self._make_publisher()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)
        if self.publisher is not None and self.connect_to is None:
            self.pub_endpoint = self.publisher.endpoint
            if self.publisher.replay_endpoint is not None:
                self.replay_endpoint_spec = self.publisher.replay_endpoint
        self.worker = build_worker(build_config(self.raw), self.publisher)
        self.runner = web.AppRunner(build_worker_app(self.worker), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        while True:
            try:
                await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()


def make_config(workers: list[SimWorker], *, worker_extra: dict[str, dict[str, Any]] | None = None,
                **overrides: Any) -> GatewayConfig:
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": MODEL, "block_size": BLOCK_SIZE, "default_max_tokens": 4}],
        "workers": [w.gateway_entry(**(worker_extra or {}).get(w.worker_id, {})) for w in workers],
        "policy": {"name": "cache_aware"},
        "admin": {"token": TOKEN},
        "health": {"interval_s": 3600},
        "load_poll": {"interval_s": 3600},
        "retry": {"max_retries": 2, "backoff_initial_s": 0.0},
        "ready_timeout_s": 60,
    }
    return config_with_overrides(raw, overrides)


class Gw(LoopbackGateway):
    """The gateway app on a loopback port."""

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
                   ) -> tuple[int, dict[str, str], Any]:
        assert self.session is not None
        async with self.session.post(self.url + path, json=body, headers=headers) as resp:
            raw = await resp.read()
            return resp.status, dict(resp.headers), json.loads(raw) if raw else None

    async def complete(self, prompt: str, headers: dict[str, str] | None = None, **fields: Any,
                       ) -> tuple[str, int, int]:
        """A non-streamed completion: (worker, predicted cached tokens, reported cached tokens)."""
        status, hdrs, body = await self.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                                 **fields}, headers)
        assert status == 200, body
        return (hdrs["x-kvgate-worker"], int(hdrs["x-kvgate-predicted-cached-tokens"]),
                body["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def get(self, path: str) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.request(method, self.url + path, json=body,
                                        headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            return resp.status, await resp.json()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the loop until it holds; fails only if it never does within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def num_indexed_blocks(gw: Gateway, worker_id: str, medium: str | None = None) -> int:
    by_medium = gw.indexes[MODEL].stats().num_blocks_by_worker.get(worker_id, {})
    if medium is not None:
        return int(by_medium.get(medium, 0))
    return int(sum(by_medium.values()))


def worker_blocks(w: SimWorker, medium: str = "GPU") -> int:
    """Cached blocks the worker itself holds on a tier (its ground truth)."""
    kv = w.core.kv
    if medium == "GPU":
        return int(kv.gpu.num_cached_blocks)
    return int(kv.cpu.num_stored_blocks) if kv.cpu is not None else 0


async def in_sync(gw: Gateway, workers: list[SimWorker], timeout_s: float = 10.0) -> None:
    """Wait until the gateway's index holds exactly the GPU and CPU blocks each worker holds."""
    def check() -> bool:
        return all(num_indexed_blocks(gw, w.worker_id, "GPU") == worker_blocks(w, "GPU")
                   and num_indexed_blocks(gw, w.worker_id, "CPU") == worker_blocks(w, "CPU") for w in workers)

    try:
        await wait_until(check, timeout_s, "index in sync with the workers")
    except AssertionError:
        counts = {w.worker_id: {m: (num_indexed_blocks(gw, w.worker_id, m), worker_blocks(w, m))
                                for m in ("GPU", "CPU")} for w in workers}
        raise AssertionError(f"index not in sync with the workers after {timeout_s} s: (indexed, held) "
                             f"{counts}") from None


async def connected(g: Gw, workers: list[SimWorker], timeout_s: float = 10.0) -> None:
    """Wait until the gateway is ready and follows each worker's live stream (ZMQ joins asynchronously).

    A probe request goes straight to each worker until its blocks show in the gateway's index; then the worker's
    prefix cache is reset (published as ``AllBlocksCleared``) so the test starts from empty workers.
    """
    await wait_until(lambda: g.gw.fleet.is_ready(), timeout_s, "ready")
    async with aiohttp.ClientSession() as s:
        for w in workers:
            if not w.with_events:
                continue
            async with asyncio.timeout(timeout_s):
                n = 0
                while True:
                    n += 1
                    prompt = f"probe {w.worker_id} {n} " + "p" * 64
                    async with s.post(w.url + "/v1/completions",
                                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as resp:
                        assert resp.status == 200
                    with contextlib.suppress(AssertionError):
                        await in_sync(g.gw, [w], timeout_s=0.5)
                        if num_indexed_blocks(g.gw, w.worker_id) > 0:
                            break
            async with s.post(w.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            await in_sync(g.gw, [w])


@contextlib.asynccontextmanager
async def running(*workers: SimWorker) -> AsyncIterator[list[SimWorker]]:
    started: list[SimWorker] = []
    try:
        for w in workers:
            started.append(await w.start())
        yield started
    finally:
        for w in started:
            await w.stop()

