"""The gateway against real sim workers publishing real KV events: snapshot warm-up spliced with the live stream,
load polling, restarts, and the scenario tables of the gateway issue (with the honesty check on every request).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from common.tokenization import encode_prompt, load_tokenizer
from events.types import BlockStored, Medium
from router.request_view import PromptView
from tests.router.sim_fleet import (
    BLOCK_SIZE,
    MODEL,
    Clock,
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

TOKENIZER, _ = load_tokenizer(None)
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
                states, _ = g.gw.router.states((fleet.workers["w0"],), PromptView(1, (), 16), 0.0, 0, None)
                assert states[0].num_running_requests == 1
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
            num_direct_prompts = 0
            if detected_by == "start_id":
                # the worker publishes nothing: only its load endpoint tells that it restarted
                await g.gw.fleet.poll_load_once()
                assert g.gw.fleet.workers["w0"].start_id == w0.worker.start_id
            else:
                # seq 0 after seq > 0, once the gateway's SUB has reconnected to the new PUB (what a process
                # publishes before that is lost, like on any PUB/SUB; the snapshot brings it back)
                counters = g.gw.subscriber.counters
                await wait_until(lambda: counters.num_reconnects[w0.pub_endpoint] >= 1, what="reconnect")
                # The SUB's subscription reaches the new PUB a moment after the reconnect: until then what the
                # worker publishes is dropped. Send distinct 3-block prompts until one arrives.
                while True:
                    await direct(w0, chr(ord("n") + num_direct_prompts) * 48)
                    num_direct_prompts += 1
                    try:
                        await wait_until(lambda: sum(counters.resyncs.values()) > resyncs_before, timeout_s=1.0)
                        break
                    except AssertionError:
                        if num_direct_prompts == 10:
                            raise
            await wait_until(lambda: sum(g.gw.subscriber.counters.resyncs.values()) > resyncs_before,
                             what="a resync")
            reasons = {reason for (wid, reason) in g.gw.subscriber.counters.resyncs if wid == "w0"}
            assert reasons & {"start_id_changed", "seq_backwards", "reconnect", "gap_unrecoverable"}
            await wait_until(lambda: g.gw.fleet.workers["w0"].is_warm, what="w0 warm again")
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == worker_blocks(w0)
            assert num_indexed_blocks(g.gw, "w0") == 3 * num_direct_prompts
            # nothing of the old cache is predicted any more; the live stream is followed again
            worker, predicted, reported = await g.complete(PREFIX, headers={"x-kvgate-worker": "w0"})
            assert (worker, predicted, reported) == ("w0", 0, 0)
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == worker_blocks(w0)
            assert g.gw.proxy.num_honesty_mismatches == 0


# -- scenario tables ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "expected_worker", "expected_cached"),
    [
        ({"w0": 2, "w1": 6, "w2": 4}, "w1", 6 * BLOCK_SIZE),
        ({"w0": 8, "w1": 6, "w2": 0}, "w0", 8 * BLOCK_SIZE),
        # full-prompt hit: the last prompt token is always computed -> (n - 1) // block_size blocks
        ({"w2": 10}, "w2", 9 * BLOCK_SIZE),
    ],
)
async def test_longest_prefix_wins(held, expected_worker, expected_cached):
    async with running(*(SimWorker(f"w{i}") for i in range(3))) as ws:
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            for w in ws:
                if held.get(w.worker_id):
                    await direct(w, PREFIX[: held[w.worker_id] * BLOCK_SIZE])
            await in_sync(g.gw, ws)
            assert await g.complete(PREFIX) == (expected_worker, expected_cached, expected_cached)
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_load_overrides_cache_at_the_threshold():
    """cache_aware with max_running_requests=2: the holder with 2 requests running (its /load) loses."""
    slow = {"decode-s-per-seq": 0.05}
    config_workers = [SimWorker("w0", timing=slow, time_scale=1.0), SimWorker("w1")]
    async with running(*config_workers) as ws:
        config = make_config(ws, policy={"name": "cache_aware", "max_running_requests": 2})
        async with Gw(config) as g:
            await connected(g, ws)
            await direct(ws[0], PREFIX)
            await in_sync(g.gw, ws)
            background: list[asyncio.Task[int]] = []
            try:
                for num_running, expected in ((1, "w0"), (2, "w1")):
                    background.append(asyncio.create_task(direct(ws[0], f"busy {num_running} " * 8, 400)))
                    await wait_until(lambda n=num_running: ws[0].core.scheduler.num_running == n, what="running")
                    await g.gw.fleet.poll_load_once()
                    assert g.gw.fleet.workers["w0"].load.num_running_requests == num_running
                    worker, predicted, reported = await g.complete(PREFIX)
                    assert worker == expected
                    assert predicted == reported
            finally:
                for task in background:
                    task.cancel()
                for task in background:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task


async def test_tier_order_gpu_over_cpu_over_pool():
    """w0 holds the prompt only on CPU (evicted from GPU), w1 on GPU, w2 only in the shared pool (MOONCAKE; w0 and
    w2 are its members)."""
    prompt = PREFIX[: 8 * BLOCK_SIZE]
    ws_ = [SimWorker("w0", num_gpu_blocks=24, num_cpu_blocks=256), SimWorker("w1"), SimWorker("w2"), SimWorker("w3")]
    async with running(*ws_) as ws:
        pools = {w.worker_id: {"pools": ["MOONCAKE"]} for w in ws if w.worker_id in ("w0", "w2")}
        async with Gw(make_config(ws, worker_extra=pools)) as g:
            await connected(g, ws)
            await direct(ws[0], prompt)
            for i in range(3):  # fill w0's 24 GPU blocks with other prefixes: the prompt's blocks go (LRU)
                await direct(ws[0], chr(ord("A") + i) * (8 * BLOCK_SIZE))
            await in_sync(g.gw, ws)
            assert worker_blocks(ws[0], "CPU") >= 8
            # the pool copy: a store on the shared tier, published on w2's stream (the sim worker has no pool)
            seq = ws[2].publisher.publish([BlockStored(
                block_hashes=tuple(range(1000, 1008)), parent_block_hash=None,
                token_ids=tuple(encode_prompt(TOKENIZER, prompt)), block_size=BLOCK_SIZE, medium=Medium.MOONCAKE)])
            ws[2].core.last_published_seq = seq
            await wait_until(lambda: num_indexed_blocks(g.gw, "w2", "MOONCAKE") == 8, what="pool blocks")
            cached = 8 * BLOCK_SIZE
            # CPU (w0) over pool (w2) over nothing (w1, w3)
            worker, predicted, reported = await g.complete(prompt + "?")
            assert (worker, predicted, reported) == ("w0", cached, cached)  # restored from CPU
            for c in "DEF":  # evicted from w0's GPU again
                await direct(ws[0], c * (8 * BLOCK_SIZE))
            # GPU (w1) over CPU (w0) over pool (w2)
            await direct(ws[1], prompt)
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0", "GPU") == worker_blocks(ws[0], "GPU")
            worker, predicted, reported = await g.complete(prompt + "!")
            assert (worker, predicted, reported) == ("w1", cached, cached)
            # pool (w2) over nothing (w3), with w0 and w1 drained
            await g.admin("POST", "/admin/workers/w0/drain")
            await g.admin("POST", "/admin/workers/w1/drain")
            worker, predicted, _ = await g.complete(prompt + ".")
            assert (worker, predicted) == ("w2", cached)  # the sim worker itself has no pool: it recomputes


async def chat_turn(g: Gw, messages: list[dict[str, str]], headers: dict[str, str] | None = None,
                    ) -> tuple[str, str, int, int]:
    """One chat turn: (worker, decision reason, predicted cached tokens, reported cached tokens); the assistant's
    reply is appended to ``messages``."""
    status, hdrs, body = await g.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                               "max_tokens": 6}, headers)
    assert status == 200, body
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return (hdrs["x-kvgate-worker"], hdrs["x-kvgate-decision"], int(hdrs["x-kvgate-predicted-cached-tokens"]),
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_sticky_expiry_with_an_injected_clock_and_the_owner_dying_mid_session():
    clock = Clock()
    async with running(SimWorker("w0"), SimWorker("w1")) as ws:
        config = make_config(
            ws, policy={"name": "session_sticky", "inner": {"name": "cache_aware"}},
            sessions={"idle_timeout_s": 60}, health={"interval_s": 3600, "failure_threshold": 1})
        async with Gw(config, clock=clock) as g:
            await connected(g, ws)
            hdr = {"x-session-id": "s1"}
            messages = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "hi"}]
            owner, reason, predicted, reported = await chat_turn(g, messages, hdr)
            assert (reason, predicted, reported) == ("sticky_new", 0, 0)
            for turn in range(2):
                await in_sync(g.gw, ws)
                messages.append({"role": "user", "content": f"turn {turn} " * 6})
                worker, reason, predicted, reported = await chat_turn(g, messages, hdr)
                assert (worker, reason) == (owner, "sticky")
                assert predicted == reported > 0
            clock.offset_s += 61  # idle past the timeout: the session expired, the request claims it afresh
            await in_sync(g.gw, ws)
            messages.append({"role": "user", "content": "after a pause"})
            worker, reason, predicted, reported = await chat_turn(g, messages, hdr)
            assert (worker, reason) == (owner, "sticky_new")  # the cache still makes it the best
            assert predicted == reported > 0
            # the owner dies mid-session: one failed health check (threshold 1) and the session moves
            dead = next(w for w in ws if w.worker_id == owner)
            other = next(w for w in ws if w.worker_id != owner)
            await dead.stop()
            await g.gw.fleet.check_health_once()
            assert not g.gw.fleet.workers[owner].is_healthy
            messages.append({"role": "user", "content": "still there?"})
            worker, reason, predicted, reported = await chat_turn(g, messages, hdr)
            assert (worker, reason, predicted, reported) == (other.worker_id, "sticky_moved", 0, 0)
            sessions = await g.gw.sessions.list_sessions(10)
            assert [(s.session_key, s.worker_id) for s in sessions] == [("sid:s1", other.worker_id)]
            await in_sync(g.gw, [other])
            messages.append({"role": "user", "content": "good"})
            worker, reason, predicted, reported = await chat_turn(g, messages, hdr)
            assert (worker, reason) == (other.worker_id, "sticky")
            assert predicted == reported > 0
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_drain_and_undrain():
    async with running(SimWorker("w0"), SimWorker("w1")) as ws:
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            await direct(ws[0], PREFIX)
            await in_sync(g.gw, ws)
            assert (await g.admin("POST", "/admin/workers/w0/drain"))[0] == 200
            assert await g.complete(PREFIX) == ("w1", 0, 0)
            assert (await g.admin("POST", "/admin/workers/w0/undrain"))[0] == 200
            await in_sync(g.gw, ws)
            assert await g.complete(PREFIX + "x") == ("w0", 10 * BLOCK_SIZE, 10 * BLOCK_SIZE)


async def test_workers_without_events_in_approximate_mode():
    ws_ = [SimWorker("a0", with_events=False), SimWorker("a1", with_events=False)]
    async with running(*ws_) as ws:
        async with Gw(make_config(ws)) as g:
            assert all(g.gw.fleet.workers[w.worker_id].is_approximate for w in ws)
            await wait_until(g.gw.fleet.is_ready, what="ready")
            first, predicted, reported = await g.complete(PREFIX)
            assert (predicted, reported) == (0, 0)
            # the decision inserted the prompt's blocks for the chosen worker: the same prefix follows it
            for suffix in ("", "more", "and more"):
                assert await g.complete(PREFIX + suffix) == (first, 9 * BLOCK_SIZE + (BLOCK_SIZE if suffix else 0),
                                                              9 * BLOCK_SIZE + (BLOCK_SIZE if suffix else 0))


async def test_honesty_over_a_scripted_multi_turn_chat():
    async with running(*(SimWorker(f"w{i}") for i in range(3))) as ws:
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            conversations = [[{"role": "system", "content": f"Agent {c}. " * 12}] for c in range(3)]
            num_cached = 0
            for turn in range(5):
                for c, messages in enumerate(conversations):
                    messages.append({"role": "user", "content": f"step {turn} of task {c}: " + "go " * (4 + turn)})
                    _, _, predicted, reported = await chat_turn(g, messages)
                    assert predicted == reported, (turn, c)
                    num_cached += reported
                    await in_sync(g.gw, ws)  # the next turn is routed on the events of this one
            assert num_cached > 0
            assert g.gw.proxy.num_honesty_checks == 15
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_honesty_over_a_workload_with_evictions():
    """Small GPU pools (w0 also with a CPU tier): prefixes are evicted, restored from CPU and recomputed."""
    ws_ = [SimWorker("w0", num_gpu_blocks=40, num_cpu_blocks=64), SimWorker("w1", num_gpu_blocks=40)]
    async with running(*ws_) as ws:
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            system = "shared system prompt " * 2
            prompts = [system + chr(ord("A") + i) * (6 * BLOCK_SIZE) for i in range(7)]
            order = [(i * 5 + i // 3) % 7 for i in range(28)]  # revisits after evictions
            num_cached = 0
            for i in order:
                _, predicted, reported = await g.complete(prompts[i] + f" #{i}")
                assert predicted == reported, i
                num_cached += reported
                await in_sync(g.gw, ws)
            assert sum(w.core.kv.gpu.num_evicted_blocks for w in ws) > 0
            assert num_cached > 0
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_honesty_with_add_generation_prompt_false():
    """The chat is rendered with the generation prompt only when the request asks for it, as the worker does."""
    async with running(SimWorker("w0")) as ws:
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            messages = [{"role": "system", "content": "S" * 40}, {"role": "user", "content": "U" * 45}]

            async def turn(**fields: object) -> tuple[int, int, int]:
                status, hdrs, body = await g.post("/v1/chat/completions",
                                                  {"model": MODEL, "messages": messages, "max_tokens": 1, **fields})
                assert status == 200, body
                await in_sync(g.gw, ws)
                return (body["usage"]["prompt_tokens"], int(hdrs["x-kvgate-predicted-cached-tokens"]),
                        body["usage"]["prompt_tokens_details"]["cached_tokens"])

            # 103 tokens without the generation prompt, 114 with it (<|im_start|>assistant\n); 16-token blocks.
            assert await turn() == (114, 0, 0)
            assert await turn() == (114, 112, 112)
            assert await turn(add_generation_prompt=False) == (103, 96, 96)
            assert await turn(add_generation_prompt=False) == (103, 96, 96)
            assert await turn(add_generation_prompt=True) == (114, 112, 112)
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_empty_cache_salt_is_refused_by_gateway_and_worker_alike():
    """vLLM refuses ``cache_salt: ""`` (400, param cache_salt); the gateway and the sim worker do the same, and a
    non-empty salt is its own namespace on both sides."""
    message = "Parameter 'cache_salt' must be a non-empty string if provided."
    prompt = "salt probe " * 20  # 220 tokens: 13 full blocks cacheable
    async with running(SimWorker("w0")) as ws:
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": ""}
            status, _, out = await g.post("/v1/completions", body)
            assert (status, out["error"]["param"], out["error"]["message"]) == (400, "cache_salt", message)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
                    "cache_salt": ""}
            status, _, out = await g.post("/v1/chat/completions", chat)
            assert (status, out["error"]["param"], out["error"]["message"]) == (400, "cache_salt", message)
            assert ws[0].core.kv.gpu.num_cached_blocks == 0  # nothing reached the worker
            async with aiohttp.ClientSession() as s:
                for path, direct_body in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                    async with s.post(ws[0].url + path, json=direct_body) as resp:
                        out = await resp.json()
                        assert (resp.status, out["error"]["param"], out["error"]["message"]) == (
                            400, "cache_salt", message)
            assert await g.complete(prompt) == ("w0", 0, 0)
            await in_sync(g.gw, ws)
            assert await g.complete(prompt, cache_salt="t") == ("w0", 0, 0)
            await in_sync(g.gw, ws)
            assert await g.complete(prompt, cache_salt="t") == ("w0", 208, 208)
            assert await g.complete(prompt) == ("w0", 208, 208)
            assert g.gw.proxy.num_honesty_mismatches == 0


@pytest.mark.parametrize(("num_prompt_tokens", "expected_cached"), [(64, 32), (96, 64), (97, 96)])
async def test_a_worker_with_twice_the_model_block_size_is_predicted_in_its_own_blocks(num_prompt_tokens,
                                                                                       expected_cached):
    """A worker caching 32-token blocks behind a model of 16-token blocks: its hits end at its own block
    boundaries before the last prompt token, and the prediction says the same."""
    w0 = SimWorker("w0")
    w0.raw["kv-cache"]["block-size"] = 2 * BLOCK_SIZE
    async with running(w0) as ws, Gw(make_config(ws, worker_extra={"w0": {"block_size": 2 * BLOCK_SIZE}})) as g:
        await wait_until(g.gw.fleet.is_ready, what="ready")
        prompt = PREFIX[:num_prompt_tokens]
        assert await direct(ws[0], prompt) == 0
        # The index keys the model's 16-token blocks: two per block the worker stores.
        await wait_until(lambda: num_indexed_blocks(g.gw, "w0", "GPU") == 2 * worker_blocks(ws[0]) > 0,
                         what="the worker's blocks indexed")
        status, headers, body = await g.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert status == 200
        reported = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (int(headers["x-kvgate-predicted-cached-tokens"]), reported) == (expected_cached, expected_cached)
