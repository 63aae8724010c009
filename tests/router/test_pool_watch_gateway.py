"""The gateway's pool watcher in front of two sim workers sharing one real Mooncake pool: worker B serves a prefix
worker A stored, predicted as reported; once the master no longer holds it, the gateway stops predicting it,
through the next sweep or through the decision check that runs before the request is sent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("mooncake.store")

from loadgen.mooncake_master import MooncakeMaster  # noqa: E402
from tests.mooncake_master import running_master  # noqa: E402
from tests.router import sim_fleet  # noqa: E402
from tests.router.sim_fleet import BLOCK_SIZE, Gw, SimWorker, connected, running, wait_until  # noqa: E402
from workers.kv.pool_tier import pool_key  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with running_master(lease_ttl_ms=3000) as m:
        yield m


def pooled(worker_id: str, master: MooncakeMaster, segment_bytes: int) -> SimWorker:
    w = SimWorker(worker_id)
    w.raw["kv-cache"]["pool"] = {"backend": "mooncake", "master-address": master.address,
                                 "global-segment-size": segment_bytes, "local-buffer-size": 16 << 20}  # fmt: skip
    return w


def text(seed: int, num_blocks: int) -> str:
    return "".join(chr(ord("a") + (seed * 7 + i) % 26) for i in range(num_blocks * BLOCK_SIZE))


async def next_sweep(g: Gw) -> None:
    watcher = g.gw.pool_watcher
    assert watcher is not None
    n = watcher.num_sweeps
    await wait_until(lambda: watcher.num_sweeps >= n + 2, 10.0, "two more sweeps")  # one began after now


async def test_b_serves_what_a_stored_and_the_gateway_stops_predicting_what_the_master_lost(master: MooncakeMaster):
    a, b = pooled("a", master, 32 << 20), pooled("b", master, 0)
    async with running(a, b) as ws:
        config = sim_fleet.make_config(
            ws, worker_extra={"a": {"pools": ["MOONCAKE"]}, "b": {"pools": ["MOONCAKE"]}},
            pool_watch={"admin_url": master.admin_url, "lease_ttl_s": 3.0, "entry_ttl_s": 3.0, "interval_s": 0.5,
                        "decision_check_budget_s": 0.5},
        )  # fmt: skip
        async with Gw(config) as g:
            await connected(g, ws)
            watcher = g.gw.pool_watcher
            assert watcher is not None
            to_a, to_b = {"x-kvgate-worker": "a"}, {"x-kvgate-worker": "b"}
            def pool_blocks() -> int:
                return sim_fleet.num_indexed_blocks(g.gw, "a", "MOONCAKE")

            def stored_here() -> list:
                return a.core.kv.pool.snapshot_metas()  # a stored them, in order (it read none)

            base = pool_blocks()
            shared = text(1, 6)
            assert await g.complete(shared + "!", to_a) == ("a", 0, 0)
            await wait_until(lambda: pool_blocks() == base + 6, what="a's pool stores")
            assert await g.complete(shared + "?", to_b) == ("b", 6 * BLOCK_SIZE, 6 * BLOCK_SIZE)  # from the pool

            swept = text(2, 5)  # stored, then gone from the master: the next sweep drops it
            assert await g.complete(swept + "!", to_a) == ("a", 0, 0)
            await wait_until(lambda: pool_blocks() == base + 11, what="stores")
            a.core.kv.pool.store.remove([pool_key(m.block_hash) for m in stored_here()[-5:]])
            dropped = watcher.num_entries_dropped
            await next_sweep(g)
            assert watcher.num_entries_dropped == dropped + 5
            assert await g.complete(swept + "?", to_b) == ("b", 0, 0)  # predicted as the worker sees it: nothing

            checked = text(3, 4)  # known to the watcher, then gone: the decision check finds out first
            assert await g.complete(checked + "!", to_a) == ("a", 0, 0)
            await wait_until(lambda: pool_blocks() == base + 10, what="stores")
            await next_sweep(g)
            gone = stored_here()[-2:]  # blocks 2 and 3 of the prompt
            assert [m.depth for m in gone] == [2, 3]
            a.core.kv.pool.store.remove([pool_key(m.block_hash) for m in gone])
            drops = watcher.num_check_drops
            assert await g.complete(checked + "?", to_b) == ("b", 2 * BLOCK_SIZE, 2 * BLOCK_SIZE)
            assert watcher.num_check_drops == drops + 2 and watcher.num_checks_unanswered == 0
            assert g.gw.proxy.num_honesty_mismatches == 0
