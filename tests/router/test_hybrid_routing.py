"""The gateway in front of hybrid sim workers (full attention + sliding window + recurrent state): the per-group hit
rule in ``match()``, priced by ``cache_aware``; predicted cached tokens equal the reported ones; ``/admin/index``
per group; a removed checkpoint stops attracting traffic. Real workers, real ZMQ events, real HTTP on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from router.app import Gateway
from tests.router.sim_fleet import BLOCK_SIZE, MODEL, Gw, SimWorker, make_config, running, wait_until

pytestmark = [pytest.mark.integration]

WINDOW_TOKENS = 64
STATE_BYTES = 1 << 20
WORKER_GROUPS = [
    {"kind": "full"},
    {"kind": "sliding_window", "sliding-window-tokens": WINDOW_TOKENS},
    {"kind": "recurrent", "state-bytes": STATE_BYTES},
]
INDEX_GROUPS = [
    {"kind": "full"},
    {"kind": "sliding_window", "sliding-window-tokens": WINDOW_TOKENS},
    {"kind": "recurrent"},
]


def hybrid_worker(worker_id: str, **checkpoints: Any) -> SimWorker:
    w = SimWorker(worker_id)
    w.raw["kv-cache"]["groups"] = WORKER_GROUPS
    w.raw["kv-cache"]["checkpoints"] = {"interval-tokens": 0, **checkpoints}
    return w


def truth(w: SimWorker) -> dict[str, dict[str, int]]:
    """Per group, the blocks the worker itself holds on GPU (checkpoints for the recurrent group)."""
    kv = w.core.kv
    out = {"0": {"GPU": kv.gpu.num_cached_blocks}}
    for sliding in kv.groups.sliding:
        out[str(sliding.group_idx)] = {"GPU": sliding.pool.num_cached_blocks}
    for recurrent in kv.groups.recurrent:
        out[str(recurrent.group_idx)] = {"GPU": len(recurrent.checkpoint_hashes())}
    return out


def indexed(gw: Gateway, worker_id: str) -> dict[str, dict[str, int]]:
    """Per declared group, the worker's GPU entries in the index."""
    by_group = gw.indexes[MODEL].stats().num_blocks_by_group
    return {g: {"GPU": by_group[g].get(worker_id, {}).get("GPU", 0)} for g in by_group}


async def in_sync(gw: Gateway, workers: list[SimWorker], timeout_s: float = 10.0) -> None:
    await wait_until(lambda: all(indexed(gw, w.worker_id) == truth(w) for w in workers), timeout_s,
                     "every group of the index in sync with the workers")


async def connected(g: Gw, workers: list[SimWorker]) -> None:
    """Ready, following each worker's stream (a probe shows in the index), then every worker reset to empty."""
    await wait_until(lambda: g.gw.fleet.is_ready(), 10.0, "ready")
    async with aiohttp.ClientSession() as s:
        for w in workers:
            async with asyncio.timeout(10.0):
                n = 0
                while True:
                    n += 1
                    async with s.post(w.url + "/v1/completions",
                                      json={"model": MODEL, "prompt": f"probe {n} " + "p" * 64, "max_tokens": 1}):
                        pass
                    with contextlib.suppress(AssertionError):
                        await in_sync(g.gw, [w], timeout_s=0.5)
                        if indexed(g.gw, w.worker_id)["0"]["GPU"] > 0:
                            break
            async with s.post(w.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            await in_sync(g.gw, [w])


def gateway_config(workers: list[SimWorker]) -> Any:
    return make_config(workers, index={"groups": INDEX_GROUPS})


async def test_multi_turn_chat_resumes_after_the_generated_tokens_and_predicted_equals_reported():
    async with running(hybrid_worker("w0"), hybrid_worker("w1")) as ws:
        async with Gw(gateway_config(ws)) as g:
            await connected(g, ws)
            messages: list[dict[str, str]] = [{"role": "system", "content": "You are a coding agent. " * 8}]
            previous_end = 0  # tokens the previous turn computed (prompt + generated - 1)
            workers = []
            for turn in range(4):
                messages.append({"role": "user", "content": f"turn {turn}: run the tests " + "x" * (10 + turn)})
                status, hdrs, body = await g.post(
                    "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 24}
                )
                assert status == 200, body
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                predicted = int(hdrs["x-kvgate-predicted-cached-tokens"])
                usage = body["usage"]
                reported = usage["prompt_tokens_details"]["cached_tokens"]
                assert predicted == reported, turn
                # the previous turn's generation-end checkpoint: every token it computed, in whole blocks
                assert reported == previous_end // BLOCK_SIZE * BLOCK_SIZE, turn
                previous_end = usage["prompt_tokens"] + usage["completion_tokens"] - 1
                workers.append(hdrs["x-kvgate-worker"])
                await in_sync(g.gw, ws)
            assert len(set(workers)) == 1  # the state's owner keeps the session
            assert g.gw.proxy.num_honesty_mismatches == 0 and g.gw.proxy.num_honesty_checks == 4


async def test_admin_index_shows_each_groups_entries():
    async with running(hybrid_worker("w0")) as ws:
        async with Gw(gateway_config(ws)) as g:
            await connected(g, ws)
            await g.complete("a" * (10 * BLOCK_SIZE) + "?")  # 161 tokens, 2 generated: 10 full blocks computed
            await in_sync(g.gw, ws)
            status, body = await g.admin("GET", "/admin/index")
            assert status == 200
            # group 0: 10 blocks; the window (64 tokens) group: 10 stored, none evicted (its pool is not full);
            # recurrent: the prompt end and the generation end are the same boundary (block 9): 1 checkpoint
            assert body[MODEL]["num_blocks_by_group"] == {
                "0": {"w0": {"GPU": 10}},
                "1": {"w0": {"GPU": 10}},
                "2": {"w0": {"GPU": 1}},
            }
            assert body[MODEL]["num_blocks_by_worker"] == {"w0": {"GPU": 21}}


async def test_a_removed_checkpoint_stops_attracting_traffic():
    # w0 keeps 1 checkpoint: another request evicts a prompt's checkpoint while its attention blocks stay
    async with running(hybrid_worker("w0", **{"max-checkpoints": 1}), hybrid_worker("w1")) as ws:
        w0, w1 = ws
        async with Gw(gateway_config(ws)) as g:
            await connected(g, ws)
            prompt = "".join(chr(ord("a") + i % 26) for i in range(12 * BLOCK_SIZE))
            _, _, reported = await g.complete(prompt, headers={"x-kvgate-worker": "w0"})
            _, _, reported_half = await g.complete(prompt[: 6 * BLOCK_SIZE], headers={"x-kvgate-worker": "w1"})
            assert (reported, reported_half) == (0, 0)
            await in_sync(g.gw, ws)
            # Both hold a checkpoint inside the prompt: w0 at 12 blocks (its prompt's end), w1 at 6.
            worker, predicted, reported = await g.complete(prompt + " next")
            assert (worker, predicted, reported) == ("w0", 12 * BLOCK_SIZE, 12 * BLOCK_SIZE)
            await in_sync(g.gw, ws)
            await g.complete("another prompt " * 8, headers={"x-kvgate-worker": "w0"})
            await in_sync(g.gw, ws)
            assert len(w0.core.kv.groups.recurrent[0].checkpoint_hashes()) == 1  # the other prompt's
            index = g.gw.indexes[MODEL]
            assert index.stats().num_blocks_by_group["0"]["w0"]["GPU"] >= 12  # the prompt's blocks are still there
            # w0's attention blocks without a state to resume from are worth nothing; w1's checkpoint at 6 blocks is.
            worker, predicted, reported = await g.complete(prompt + " again")
            assert (worker, predicted, reported) == ("w1", 6 * BLOCK_SIZE, 6 * BLOCK_SIZE)
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_events_of_an_undeclared_group_are_refused_and_counted_on_the_real_stream():
    # the index declares groups 0 and 1 only: the worker's checkpoints (group 2) arrive on its ZMQ stream
    async with running(hybrid_worker("w0")) as ws:
        (w0,) = ws
        async with Gw(make_config(ws, index={"groups": INDEX_GROUPS[:2]})) as g:
            await wait_until(lambda: g.gw.fleet.is_ready(), 10.0, "ready")
            index = g.gw.indexes[MODEL]

            def group0() -> int:
                return index.stats().num_blocks_by_group["0"].get("w0", {}).get("GPU", 0)

            n = 0
            while group0() == 0:  # until the stream is followed (a probe shows in the index)
                n += 1
                await g.complete(f"probe {n} " + "p" * 64, headers={"x-kvgate-worker": "w0"})
                with contextlib.suppress(AssertionError):
                    await wait_until(lambda: group0() > 0, 0.5, "a probe indexed")
            await wait_until(lambda: group0() == w0.core.kv.gpu.num_cached_blocks, 10.0, "group 0 in sync")
            # each probe left one checkpoint (group 2): all n refused before the prompt is sent (a checkpoint's
            # event can come in a later batch than its group 0 blocks)
            await wait_until(lambda: index.stats().counters["num_unknown_group_events"] == n, 10.0,
                             "the probes' checkpoints refused")
            refused = n
            num_before = w0.core.kv.gpu.num_cached_blocks
            await g.complete("a" * (10 * BLOCK_SIZE) + "?", headers={"x-kvgate-worker": "w0"})  # 10 blocks
            await wait_until(lambda: group0() == num_before + 10, 10.0, "the prompt's blocks indexed")
            # one checkpoint (prompt end = generation end, block 9): one refused store; groups 0 and 1 indexed
            await wait_until(lambda: index.stats().counters["num_unknown_group_events"] == refused + 1, 10.0,
                             "the checkpoint refused")
            sliding = w0.core.kv.groups.sliding[0].pool
            # group 1's stores and removals may come in a later batch than the refused checkpoint
            await wait_until(lambda: index.stats().num_blocks_by_group.get("1", {}).get("w0", {}).get("GPU")
                             == sliding.num_cached_blocks, 10.0, "group 1 in sync")
            by_group = index.stats().num_blocks_by_group
            assert set(by_group) == {"0", "1"}
            assert by_group["1"]["w0"]["GPU"] == sliding.num_cached_blocks
            assert len(w0.core.kv.groups.recurrent[0].checkpoint_hashes()) == n + 1
