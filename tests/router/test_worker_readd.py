"""Removing a worker and adding the same id again while the removal still awaits its session store: the add
waits for the removal, so the old teardown never reaches the new worker's subscription, index entries or
metrics (real ZMQ events, real HTTP on loopback; the store's ``drop_worker`` is held open by an event)."""

from __future__ import annotations

import asyncio

import pytest

from events.types import BlockStored
from router.block_hash import hash_token_blocks
from tests.router.harness import BLOCK_SIZE, GatewayHarness, make_config, wait_until
from tests.router.mock_workers import MockWorker

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOKENS = list(range(2 * BLOCK_SIZE))


async def test_a_re_add_during_a_removal_waits_for_it_and_keeps_its_subscription() -> None:
    w0 = MockWorker("w0")
    await w0.start()
    try:
        config = make_config([w0])
        async with GatewayHarness(config, workers=[w0]) as h:
            gw = h.gw
            held = asyncio.Event()
            drop_worker = gw.sessions.drop_worker
            order: list[str] = []

            async def slow_drop_worker(worker_id: str) -> int:
                order.append("drop_worker waits")
                await held.wait()
                order.append("drop_worker done")
                return await drop_worker(worker_id)

            gw.sessions.drop_worker = slow_drop_worker  # type: ignore[method-assign]
            removal = asyncio.create_task(gw.remove_worker("w0"))
            await wait_until(lambda: order == ["drop_worker waits"])
            readd = asyncio.create_task(gw.add_worker(config.workers[0]))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not readd.done() and "w0" not in gw.fleet.workers  # the add waits for the removal
            held.set()
            await removal
            worker = await readd
            assert order == ["drop_worker waits", "drop_worker done"]
            assert gw.fleet.workers["w0"] is worker
            assert gw.subscriber is not None and sorted(gw.subscriber._specs["w0"]) == [0]
            # the new subscription is live: a stored block reaches the index
            await h.connect_events([w0])
            assert w0.publisher is not None
            hashes = (0x0101010101010101, 0x0202020202020202)
            w0.publisher.publish([BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tuple(TOKENS),
                                              block_size=BLOCK_SIZE)])
            query = hash_token_blocks(TOKENS, BLOCK_SIZE)
            await wait_until(lambda: "w0" in gw.indexes["m"].match(query).workers)
            assert gw.indexes["m"].match(query).workers["w0"].num_gpu_blocks == 2
            assert gw._removals == {}
    finally:
        await w0.stop()
