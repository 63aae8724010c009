"""What a removed worker leaves behind in the gateway: nothing. After the model's last worker goes, its index
tables are back at their initial size, its prompt caches are empty, and no memo key, metric series or label set
names the worker (a real sim worker over real ZMQ and HTTP on loopback); the debug memory endpoint reports the C
heap and trims it on request."""

from __future__ import annotations

import pytest

from router.index.upkeep import SHRINK_MIN_IDS
from tests.router.sim_fleet import BLOCK_SIZE, Gw, SimWorker, in_sync, make_config, running

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

NUM_PROMPTS = 5
PROMPT_BLOCKS = 1000


async def test_last_worker_removed_leaves_no_state():
    async with running(SimWorker("w0", num_gpu_blocks=8192)) as ws, Gw(make_config(ws)) as g:
        gw = g.gw
        await in_sync(gw, ws)
        for i in range(NUM_PROMPTS):  # byte-level tokens: PROMPT_BLOCKS distinct blocks per prompt
            prompt = (f"prompt {i:03d} " + "abcdefghijklmnopqrstuvwxyz" * 700)[: PROMPT_BLOCKS * BLOCK_SIZE]
            worker, predicted, reported = await g.complete(prompt)
            assert (worker, predicted, reported) == ("w0", 0, 0)
        await in_sync(gw, ws)
        index = gw.indexes["m"]
        assert index.state.num_entries == NUM_PROMPTS * PROMPT_BLOCKS
        assert len(index.state.hash_of) > SHRINK_MIN_IDS
        model = gw.tokenizers["m"]
        assert model.num_cached_bytes > 0
        assert any(key[0] == "w0" for key in gw.router._inserted_at_s)
        assert "w0" in gw.metrics.workers
        gw.metrics.retries_total.labels("w0", "TransportTimeoutError").inc()

        status, _ = await g.admin("DELETE", "/admin/workers/w0")
        assert status == 200
        assert index.state.num_entries == 0
        assert (len(index.state.hash_of), index.state.num_ids, len(index.state.gpu0)) == (1, 1, 1)
        assert model.num_cached_bytes == 0 and len(model.prefixes) == len(model.texts) == 0
        assert not any(key[0] == "w0" for key in gw.router._inserted_at_s)
        assert "w0" not in gw.metrics.workers
        text = gw.metrics.render().decode()
        assert 'worker="w0"' not in text

        status, report = await g.admin("GET", "/admin/debug/memory?limit=0&trim=1")
        assert status == 200
        heap = report["malloc"]
        assert set(heap) == {"arena_bytes", "mmap_bytes", "in_use_bytes", "free_bytes", "releasable_bytes"}
        assert heap["arena_bytes"] >= heap["in_use_bytes"] > 0 and isinstance(report["trimmed"], bool)
        for query, param in (("group_by=0", "group_by"), ("trim=maybe", "trim"), ("limit=x", "limit")):
            status, answer = await g.admin("GET", f"/admin/debug/memory?{query}")
            assert (status, answer["error"]["param"]) == (400, param)


async def test_removed_workers_sessions_and_the_last_workers_header_memo_are_released():
    """``session_sticky``'s resident sessions of a removed worker go with it (they held its session keys until
    their idle timeout, however idle the gateway); the client header memo (every request's header block: its
    ``x-session-id``, its ``Content-Length``) empties with the last worker of all."""
    policy = {"name": "session_sticky", "inner": {"name": "cache_aware"}}
    async with running(SimWorker("w0", num_gpu_blocks=4096), SimWorker("w1", num_gpu_blocks=4096)) as ws, \
            Gw(make_config(ws, policy=policy)) as g:
        gw = g.gw
        await in_sync(gw, ws)
        owners: dict[str, str] = {}
        for i in range(6):
            prompt = f"session {i} " + "lorem ipsum dolor sit amet " * 40
            worker, _, _ = await g.complete(prompt, headers={"x-session-id": f"s{i}"})
            owners[f"s{i}"] = worker
        residents = gw.router.holder.sticky.residents
        assert residents.num_sessions == 6 and len(gw.client_headers) == 6
        on_w0 = sorted(k for k, w in owners.items() if w == "w0")
        assert 0 < len(on_w0) < 6, owners  # the recent-assignment tie-break spreads new sessions over both

        status, _ = await g.admin("DELETE", "/admin/workers/w0")
        assert status == 200
        assert residents.num_sessions == 6 - len(on_w0)
        assert not any(f"s{i}" in residents for i in range(6) if owners[f"s{i}"] == "w0")
        assert residents.resident_tokens(0.0).keys() <= {"w1"}
        assert len(gw.client_headers) == 6  # w1 still serves: the memo stays

        status, _ = await g.admin("DELETE", "/admin/workers/w1")
        assert status == 200
        assert (residents.num_sessions, len(gw.client_headers)) == (0, 0)
        assert residents.resident_tokens(0.0) == {}
