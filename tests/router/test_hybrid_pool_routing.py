"""The gateway in front of hybrid sim workers sharing a pool tier (MOONCAKE): a recurrent checkpoint written
through to the pool by one worker is a hit, priced as a pool restore, for every member; predicted cached tokens
equal the reported ones. Real workers over one sim pool, real ZMQ events, real HTTP on loopback."""

from __future__ import annotations

from typing import Any

import pytest

from router.app import Gateway
from tests.router.sim_fleet import BLOCK_SIZE, MODEL, Gw, SimWorker, make_config, running, wait_until
from tests.router.test_hybrid_routing import connected, in_sync

pytestmark = [pytest.mark.integration]

STATE_BYTES = 1 << 20
POOL_NAME = "hybrid-gateway-checkpoints"


def hybrid_worker(worker_id: str, *, pooled: bool) -> SimWorker:
    w = SimWorker(worker_id)
    w.raw["kv-cache"]["groups"] = [{"kind": "full"}, {"kind": "recurrent", "state-bytes": STATE_BYTES}]
    w.raw["kv-cache"]["checkpoints"] = {"interval-tokens": 0}
    if pooled:
        w.raw["kv-cache"]["pool"] = {"backend": "sim", "name": POOL_NAME, "capacity-blocks": 4096}
    return w


def pool_entries(gw: Gateway, group: str, worker_id: str) -> int:
    by_group = gw.indexes[MODEL].stats().num_blocks_by_group
    return by_group.get(group, {}).get(worker_id, {}).get("MOONCAKE", 0)


async def test_a_pool_checkpoint_is_a_hit_for_another_member_priced_as_a_restore():
    workers = [hybrid_worker("w0", pooled=True), hybrid_worker("w1", pooled=True), hybrid_worker("w2", pooled=False)]
    async with running(*workers) as ws:
        w0, w1, w2 = ws
        pools: dict[str, dict[str, Any]] = {"w0": {"pools": ["MOONCAKE"]}, "w1": {"pools": ["MOONCAKE"]}}
        config = make_config(ws, worker_extra=pools, index={"groups": [{"kind": "full"}, {"kind": "recurrent"}]})
        async with Gw(config) as g:
            await connected(g, ws)
            prompt = "".join(chr(ord("a") + i % 26) for i in range(12 * BLOCK_SIZE))
            _, _, reported = await g.complete(prompt, headers={"x-kvgate-worker": "w0"})
            assert reported == 0
            await in_sync(g.gw, ws)
            # w0 wrote the prompt's 12 blocks and its prompt-end checkpoint (block 11) through to the pool
            await wait_until(lambda: pool_entries(g.gw, "0", "w0") >= 12 and pool_entries(g.gw, "1", "w0") >= 1,
                             10.0, "the pool copies indexed")
            await g.admin("POST", "/admin/workers/w0/drain")
            num_resumes = [w.core.kv.groups.recurrent[0].num_resumes for w in (w1, w2)]
            # w1 (a pool member, nothing of its own) over w2 (not a member): the restore beats the prefill
            worker, predicted, reported = await g.complete(prompt + " next")
            assert (worker, predicted, reported) == ("w1", 12 * BLOCK_SIZE, 12 * BLOCK_SIZE)
            # w1 resumed from w0's checkpoint, read from the pool, and announced it there
            assert [w.core.kv.groups.recurrent[0].num_resumes for w in (w1, w2)] == [num_resumes[0] + 1, num_resumes[1]]
            await wait_until(lambda: pool_entries(g.gw, "1", "w1") >= 1, 10.0, "w1's pool checkpoint indexed")
            assert g.gw.proxy.num_honesty_mismatches == 0
