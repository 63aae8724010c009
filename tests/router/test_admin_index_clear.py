"""``POST /admin/index/clear``: the body is validated (400 naming the problem, 404 for an unknown worker, nothing
cleared), and a cleared worker is re-warmed as after a resync, so its predictions recover while it still holds the
blocks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.router import sim_fleet
from tests.router.fakes import FakeWorker
from tests.router.harness import TOKEN, GatewayHarness, index_holds, make_config, wait_until
from tests.router.sim_fleet import BLOCK_SIZE, Gw, SimWorker, connected, in_sync, num_indexed_blocks, running

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
NOT_AN_OBJECT = 'the body must be a JSON object: none or {} to clear every worker, {"worker_id": "<id>"} for one; got '
NOT_AN_ID = "worker_id must be a worker id (a non-empty string), got "
PREFIX = "".join(chr(ord("a") + i % 26) for i in range(10 * BLOCK_SIZE))  # 10 blocks of byte tokens


def error(message: str, *, type_: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


async def clear(h: GatewayHarness | Gw, body: bytes) -> tuple[int, str, Any]:
    assert h.session is not None
    async with h.session.post(h.url + "/admin/index/clear", data=body, headers=AUTH) as resp:
        return resp.status, resp.content_type, await resp.json(content_type=None)


async def indexed(h: GatewayHarness, workers: list[FakeWorker]) -> dict[str, int]:
    """Each worker stores 4 blocks; returns the index's block count per worker once they are in."""
    for w in workers:
        w.store(list(range(4 * w.block_size)))
        await wait_until(index_holds(h.gw, w.worker_id, 4))
    return {w.worker_id: sum(h.gw.indexes["m"].stats().num_blocks_by_worker[w.worker_id].values()) for w in workers}


@pytest.mark.parametrize(("body", "status", "answer"), [
    (b'{"worker": "w1"}', 400, error("unknown key 'worker': the body takes only worker_id", param="worker")),
    (b'{"worker_id": "w1", "all": true}', 400, error("unknown key 'all': the body takes only worker_id",
                                                      param="all")),
    (b"[]", 400, error(NOT_AN_OBJECT + "an array")),
    (b'["w1"]', 400, error(NOT_AN_OBJECT + "an array")),
    (b"null", 400, error(NOT_AN_OBJECT + "null")),
    (b'"w1"', 400, error(NOT_AN_OBJECT + "a string")),
    (b"5", 400, error(NOT_AN_OBJECT + "a number")),
    (b'{"worker_id": null}', 400, error(NOT_AN_ID + "null", param="worker_id")),
    (b'{"worker_id": 1}', 400, error(NOT_AN_ID + "a number", param="worker_id")),
    (b'{"worker_id": ["w1"]}', 400, error(NOT_AN_ID + "an array", param="worker_id")),
    (b'{"worker_id": ""}', 400, error(NOT_AN_ID + "an empty string", param="worker_id")),
    (b'{"worker_id": "nope"}', 404, error("no worker 'nope'", type_="not_found_error", param="worker_id")),
])
async def test_a_bad_body_is_refused_and_clears_nothing(workers, body, status, answer):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        before = await indexed(h, workers)
        assert before == {"w0": 4, "w1": 4}
        assert await clear(h, body) == (status, "application/json", answer)
        stats = h.gw.indexes["m"].stats()
        assert {wid: sum(stats.num_blocks_by_worker[wid].values()) for wid in before} == before
        assert all(w.is_warm for w in h.gw.fleet.workers.values())


@pytest.mark.parametrize("body", [b"", b"{}"])
async def test_no_body_or_an_empty_object_clears_every_worker(workers, body):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        await indexed(h, workers)
        assert await clear(h, body) == (200, "application/json", {"cleared": ["w0", "w1"]})
        assert h.gw.indexes["m"].stats().num_blocks_by_worker == {"w0": {"GPU": 0}, "w1": {"GPU": 0}}


async def test_one_worker_is_cleared_then_warms_again_from_its_new_events(workers):
    """Without a snapshot (``snapshot_path: null`` in the harness) the cleared worker warms on its next batch."""
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        await indexed(h, workers)
        assert await clear(h, b'{"worker_id": "w1"}') == (200, "application/json", {"cleared": ["w1"]})
        stats = h.gw.indexes["m"].stats()
        assert {wid: sum(n.values()) for wid, n in stats.num_blocks_by_worker.items()} == {"w0": 4, "w1": 0}
        w1 = h.gw.fleet.get("w1")
        assert (w1.is_warm, w1.is_approximate) == (False, True)  # rebuilding, routed on approximate entries
        assert h.gw.fleet.get("w0").is_warm
        workers[1].store(list(range(100, 100 + 3 * workers[1].block_size)))
        await wait_until(index_holds(h.gw, "w1", 3))
        assert (w1.is_warm, w1.is_approximate) == (True, False)


async def test_a_cleared_worker_is_rewarmed_from_its_snapshot_and_its_predictions_recover():
    async with running(SimWorker("w0")) as ws, Gw(sim_fleet.make_config(ws)) as g:
        await connected(g, ws)
        assert await g.complete(PREFIX) == ("w0", 0, 0)
        await in_sync(g.gw, ws)
        assert await g.complete(PREFIX) == ("w0", 9 * BLOCK_SIZE, 9 * BLOCK_SIZE)
        assert num_indexed_blocks(g.gw, "w0") == 10
        assert await clear(g, b'{"worker_id": "w0"}') == (200, "application/json", {"cleared": ["w0"]})
        assert not g.gw.fleet.get("w0").is_warm
        await sim_fleet.wait_until(lambda: g.gw.fleet.get("w0").is_warm, what="w0 warm again")
        await in_sync(g.gw, ws)
        assert num_indexed_blocks(g.gw, "w0") == 10
        assert await g.complete(PREFIX) == ("w0", 9 * BLOCK_SIZE, 9 * BLOCK_SIZE)
        assert g.gw.proxy.num_honesty_mismatches == 0


async def test_clearing_every_worker_rewarms_each_from_its_snapshot():
    async with running(SimWorker("w0"), SimWorker("w1")) as ws, Gw(sim_fleet.make_config(ws)) as g:
        await connected(g, ws)
        prompts = {"w0": PREFIX, "w1": PREFIX[::-1]}
        for wid, prompt in prompts.items():
            assert await g.complete(prompt, headers={"x-kvgate-worker": wid}) == (wid, 0, 0)
        await in_sync(g.gw, ws)
        assert await clear(g, b"") == (200, "application/json", {"cleared": ["w0", "w1"]})
        await sim_fleet.wait_until(lambda: all(w.is_warm for w in g.gw.fleet.workers.values()), what="warm again")
        await in_sync(g.gw, ws)
        assert (num_indexed_blocks(g.gw, "w0"), num_indexed_blocks(g.gw, "w1")) == (10, 10)
        for wid, prompt in prompts.items():
            assert await g.complete(prompt, headers={"x-kvgate-worker": wid}) == (
                wid, 9 * BLOCK_SIZE, 9 * BLOCK_SIZE)
