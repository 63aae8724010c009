"""A worker restarted at the same address before the gateway saw any live batch from it (real sim worker, real ZMQ,
real HTTP): the index the gateway warmed from the worker's snapshot is dropped, not kept for a cache the new process
does not have."""

from __future__ import annotations

import aiohttp
import pytest

from tests.router.sim_fleet import (
    MODEL,
    Gw,
    SimWorker,
    in_sync,
    make_config,
    num_indexed_blocks,
    running,
    wait_until,
    worker_blocks,
)

pytestmark = [pytest.mark.integration]

PROMPT = "".join(chr(ord("a") + i % 23) for i in range(20 * 16 + 3))  # 323 byte tokens: 20 full blocks


async def test_a_restart_before_any_live_batch_drops_the_snapshot_entries():
    """The worker caches a prompt before the gateway starts; the gateway warms its index from the worker's
    snapshot (20 blocks, no live batch since); the worker restarts (new start id, empty cache): the gateway's load
    poll sees the new start id and the index is rebuilt to the worker's 0 blocks, so the same prompt is predicted
    0 cached tokens, as the worker reports."""
    async with running(SimWorker("w0")) as ws:
        w0 = ws[0]
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
            async with s.post(w0.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        num_cached = worker_blocks(w0)
        assert num_cached >= 20
        async with Gw(make_config(ws, load_poll={"interval_s": 0.05})) as g:
            await wait_until(lambda: g.gw.fleet.is_ready(), what="ready")
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == num_cached
            runtime = g.gw.fleet.workers["w0"]
            await wait_until(lambda: runtime.start_id is not None, what="the gateway's poll of the start id")
            old_start_id = runtime.start_id
            await w0.restart()
            await wait_until(lambda: runtime.start_id not in (None, old_start_id),
                             what="the gateway's poll of the new start id")
            await in_sync(g.gw, ws, timeout_s=3.0)
            assert num_indexed_blocks(g.gw, "w0") == 0
            assert await g.complete(PROMPT) == ("w0", 0, 0)
