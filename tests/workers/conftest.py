"""Fixtures: a real worker app on an ephemeral loopback port, with a real ZMQ publisher."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web

from events.publisher import KVEventPublisher, PublisherConfig
from tests.ports import free_port
from workers.config import WorkerConfig, build_config
from workers.server import Worker, build_app, build_worker


@dataclass
class RunningWorker:
    worker: Worker
    base_url: str
    events_endpoint: str | None


def make_config(**overrides: object) -> WorkerConfig:
    raw: dict[str, object] = {
        "model": "sim-model",
        "worker-id": "w-test",
        "time-scale": 0.0,
        "kv-cache": {"num-gpu-blocks": 64, "num-cpu-blocks": 0, "block-size": 4},
        "scheduler": {"max-model-len": 512, "max-num-batched-tokens": 256, "default-max-tokens": 8},
    }
    raw.update(overrides)
    return build_config(raw)


@pytest.fixture
async def start_worker() -> AsyncIterator[Callable[..., Awaitable[RunningWorker]]]:
    runners: list[web.AppRunner] = []
    publishers: list[KVEventPublisher] = []

    async def start(config: WorkerConfig | None = None, with_events: bool = False) -> RunningWorker:
        cfg = config or make_config()
        publisher = None
        endpoint = None
        if with_events:
            publisher = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*"))
            publishers.append(publisher)
            endpoint = publisher.endpoint
        worker = build_worker(cfg, publisher)
        runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return RunningWorker(worker, f"http://127.0.0.1:{port}", endpoint)

    yield start
    for r in runners:
        await r.cleanup()
    for p in publishers:
        p.close()
