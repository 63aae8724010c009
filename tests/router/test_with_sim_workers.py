"""The gateway against real sim workers publishing real KV events: snapshot warm-up spliced with the live stream,
load polling, restarts, and the scenario tables of the gateway issue (with the honesty check on every request).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from tests.router.sim_fleet import (
    BLOCK_SIZE,
    MODEL,
    Gw,
    SimWorker,
    connected,
    in_sync,
    make_config,
    num_indexed_blocks,
    running,
    wait_until,
    worker_blocks,
)

pytestmark = [pytest.mark.integration]

PREFIX = "".join(chr(ord("a") + i % 26) for i in range(10 * BLOCK_SIZE))  # 10 blocks of byte tokens


async def direct(w: SimWorker, prompt: str, max_tokens: int = 2) -> int:
    """A completion sent straight to the worker (not through the gateway); returns its cached tokens."""
    async with aiohttp.ClientSession() as s, s.post(
        w.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    ) as resp:
        assert resp.status == 200
        body = await resp.json()
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


# -- warm-up, load polling, restarts ------------------------------------------------------------------------------


async def test_snapshot_warmup_then_live_stream():
    """Blocks cached before the gateway started come from the worker's snapshot; later ones from its events."""
    async with running(SimWorker("w0"), SimWorker("w1")) as ws:
        await direct(ws[0], PREFIX)  # published before anyone subscribed: only the snapshot has it
        await direct(ws[1], "z" * 100)
        async with Gw(make_config(ws)) as g:
            await wait_until(g.gw.fleet.is_ready, what="ready")
            status, body = await g.get("/ready")
            assert (status, body) == (200, {"ready": True, "waiting_for": []})
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == 10
            assert num_indexed_blocks(g.gw, "w1") == 6
            # the live stream continues after the snapshot
            await direct(ws[1], PREFIX[:5 * BLOCK_SIZE] + "q" * 40)
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w1") == 6 + 7
            worker, predicted, reported = await g.complete(PREFIX)
            assert (worker, predicted, reported) == ("w0", 9 * BLOCK_SIZE, 9 * BLOCK_SIZE)
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_load_polling_reads_the_workers_load_endpoint():
    slow = {"decode-s-per-seq": 0.05}
    async with running(SimWorker("w0", timing=slow, time_scale=1.0)) as ws:
        async with Gw(make_config(ws)) as g:
            fleet = g.gw.fleet
            await fleet.poll_load_once()
            load = fleet.workers["w0"].load
            assert load is not None
            assert load.start_id == ws[0].worker.start_id == fleet.workers["w0"].start_id
            assert (load.num_running_requests, load.num_waiting_requests, load.kv_usage) == (0, 0, 0.0)
            task = asyncio.create_task(direct(ws[0], "r" * 64, max_tokens=200))
            try:
                await wait_until(lambda: ws[0].core.scheduler.num_running == 1, what="a running request")
                await fleet.poll_load_once()
                load = fleet.workers["w0"].load
                assert load is not None
                assert load.num_running_requests == 1
                assert load.kv_usage > 0.0
                assert fleet.workers["w0"].state(0.0).num_running_requests == 1
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


@pytest.mark.parametrize("with_replay", [True, False])
@pytest.mark.parametrize("detected_by", ["start_id", "seq_back_to_0"])
async def test_restarted_worker_is_cleared_and_rebuilt_from_its_snapshot(detected_by, with_replay):
    async with running(SimWorker("w0", with_replay=with_replay), SimWorker("w1")) as ws:
        w0 = ws[0]
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            await g.complete(PREFIX, headers={"x-kvgate-worker": "w0"})
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == 10
            old_start_id = w0.worker.start_id
            await g.gw.fleet.poll_load_once()
            await w0.restart()  # same ports, empty cache, new start id, seq from 0
            assert w0.worker.start_id != old_start_id
            resyncs_before = sum(g.gw.subscriber.counters.resyncs.values())
            if detected_by == "start_id":
                # the worker publishes nothing: only its load endpoint tells that it restarted
                await g.gw.fleet.poll_load_once()
                assert g.gw.fleet.workers["w0"].start_id == w0.worker.start_id
            else:
                # seq 0 after seq > 0, once the gateway's SUB has reconnected to the new PUB (what a process
                # publishes before that is lost, like on any PUB/SUB; the snapshot brings it back)
                counters = g.gw.subscriber.counters
                await wait_until(lambda: counters.num_reconnects[w0.pub_endpoint] >= 1, what="reconnect")
                await direct(w0, "n" * 48)
            await wait_until(lambda: sum(g.gw.subscriber.counters.resyncs.values()) > resyncs_before,
                             what="a resync")
            reasons = {reason for (wid, reason) in g.gw.subscriber.counters.resyncs if wid == "w0"}
            assert reasons & {"start_id_changed", "seq_backwards", "reconnect", "gap_unrecoverable"}
            await wait_until(lambda: g.gw.fleet.workers["w0"].is_warm, what="w0 warm again")
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == worker_blocks(w0)
            assert num_indexed_blocks(g.gw, "w0") == (3 if detected_by == "seq_back_to_0" else 0)
            # nothing of the old cache is predicted any more; the live stream is followed again
            worker, predicted, reported = await g.complete(PREFIX, headers={"x-kvgate-worker": "w0"})
            assert (worker, predicted, reported) == ("w0", 0, 0)
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == worker_blocks(w0)
            assert g.gw.proxy.num_honesty_mismatches == 0
