"""A worker whose snapshot takes longer than a health check (a large cache on a busy host) still warms the
gateway's index from it: the fetch has its own limit, ``events.snapshot_timeout_s``. It shared
``health.timeout_s`` (2 s by default), so a slow snapshot was given up for events only and every block cached
before the subscription stayed missing from the index for good (found by ``benchmarks.chaos``)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from events.encode import BatchEncoder
from events.publisher import KVEventPublisher, PublisherConfig
from events.types import AllBlocksCleared, BlockStored, EngineBlockHash
from tests.ports import free_port
from tests.router.harness import LoopbackGateway, config_with_overrides, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

BLOCK_SIZE = 4
NUM_BLOCKS = 6
SNAPSHOT_DELAY_S = 0.8


@pytest.fixture
async def slow_snapshot_worker():
    publisher = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", linger_s=0.0))
    tokens = tuple(range(1, NUM_BLOCKS * BLOCK_SIZE + 1))
    body = BatchEncoder("vllm").encode(
        [AllBlocksCleared(), BlockStored(tuple(EngineBlockHash(100 + i) for i in range(NUM_BLOCKS)), None, tokens,
                                         BLOCK_SIZE)], 1.0, 0)

    async def snapshot(request: web.Request) -> web.Response:
        await asyncio.sleep(SNAPSHOT_DELAY_S)
        return web.Response(body=body, content_type="application/msgpack", headers={"x-kvgate-last-seq": "-1"})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/kv/snapshot", snapshot)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", publisher.endpoint
    await runner.cleanup()
    publisher.close()


async def test_a_snapshot_slower_than_a_health_check_still_warms_the_index(slow_snapshot_worker):
    url, endpoint = slow_snapshot_worker
    config = config_with_overrides({
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": BLOCK_SIZE}],
        "workers": [{"id": "w0", "url": url, "model": "m", "events_endpoint": endpoint, "load_path": None}],
        "policy": {"name": "cache_aware"},
        "admin": {"disable_auth": True},
        "health": {"interval_s": 3600, "timeout_s": 0.2},
    }, {})
    assert config.events.snapshot_timeout_s == 30.0
    async with LoopbackGateway(config) as gw:
        index = gw.gw.indexes["m"]
        await wait_until(lambda: sum(index.stats().num_blocks_by_worker.get("w0", {}).values()) > 0,
                         timeout_s=10 * SNAPSHOT_DELAY_S)
        assert index.stats().num_blocks_by_worker["w0"] == {"GPU": NUM_BLOCKS}
