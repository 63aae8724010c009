"""Pending blocks: a routed request's full prompt blocks enter the index for its worker before the worker's events.

Three layers, exact values throughout:

* the sim worker's scheduler: when a request's blocks become hits for a request queued behind it (the rule the
  pending entries model, ``router.routing`` step 5);
* ``PrefixIndex.insert_approximate`` with a per-call TTL: expiry order with two TTLs in one index;
* the gateway in front of a fake worker whose KV events are held back: the second of two back-to-back requests
  with a shared prefix predicts the shared blocks and equals what the worker reports; events confirm the pending
  blocks (they stop expiring); unconfirmed ones expire; the switch turns it off; and since the lease prices a
  request's queued prefill as its prompt minus its predicted cached tokens, a request queued behind a pending one
  that shares its prefix adds only its own blocks to the worker's queue (the shared prefix is counted once).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router.config import parse_config
from router.errors import ConfigError
from router.index import IndexConfig, PrefixIndex
from tests.router.fakes import BLOCK_SIZE, FakeWorker
from tests.router.harness import Clock, GatewayHarness, make_config, wait_until
from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, Scheduler

SHARED = "S" * 40  # 10 blocks of 4 byte-tokens
TTL_S = 5.0


# ---------------------------------------------------------------------------------------------- the worker's rule


def _sched(budget: int) -> tuple[Scheduler, SimEngine]:
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=64, num_cpu_blocks=0, block_size=4))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, None), SimEngine(TimingProfile(), 4, [7], None)


def _step(sched: Scheduler, engine: SimEngine) -> None:
    sched.update(engine.execute(sched.schedule()))


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, 2, SamplingParams(seed=1))


@pytest.mark.unit
def test_sim_worker_request_behind_hits_earlier_full_prompt_blocks() -> None:
    """A (22 tokens: 5 full blocks, one chunk) runs a step; B (shares A's 5 full blocks) arrives after it."""
    sched, engine = _sched(budget=64)
    a = list(range(100, 122))
    sched.add_request(_request("a", a))
    _step(sched, engine)
    b = _request("b", a[:20] + [1, 2, 3, 4, 5, 6])
    sched.add_request(b)
    _step(sched, engine)
    assert b.num_cached_tokens == 20


@pytest.mark.unit
def test_sim_worker_chunked_prefill_request_behind_waits_for_last_chunk() -> None:
    """Budget 8: A (20 tokens) takes 3 chunks; B (FCFS) is admitted in A's last-chunk step and hits A's blocks
    computed before it: 4 blocks. vLLM caches at allocation and would also hit the last chunk's block 4; the sim
    worker caches it after that step (the one documented exception of the pending rule)."""
    sched, engine = _sched(budget=8)
    a = list(range(100, 120))
    sched.add_request(_request("a", a))
    _step(sched, engine)
    b = _request("b", a[:16] + [1, 2, 3, 4, 5])
    sched.add_request(b)
    _step(sched, engine)
    assert b.num_cached_tokens is None  # A's second chunk took the whole budget: B waits (FCFS)
    _step(sched, engine)
    assert b.num_cached_tokens == 16


# ---------------------------------------------------------------------------------------------- the index


@pytest.mark.unit
def test_index_ttl_per_insert_expires_in_expiry_order() -> None:
    index = PrefixIndex(IndexConfig(block_size=4, approx_ttl_s=120.0))
    index.insert_approximate("a", [11, 12, 13], now_s=0.0)  # index TTL: expires at 120
    index.insert_approximate("b", [11, 12], now_s=1.0, ttl_s=TTL_S)  # expires at 6, behind a's record
    assert index.match([11, 12, 13]).workers["b"].num_gpu_blocks == 2
    assert index.expire(6.0) == 2
    assert set(index.match([11, 12, 13]).workers) == {"a"}
    assert index.expire(119.9) == 0
    assert index.expire(120.0) == 3
    with pytest.raises(ValueError, match="ttl_s"):
        index.insert_approximate("a", [11], now_s=0.0, ttl_s=0.0)


# ---------------------------------------------------------------------------------------------- the gateway


class HeldEvents:
    """Wraps a fake worker's publisher: batches wait in a list until ``release``."""

    def __init__(self, worker: FakeWorker) -> None:
        assert worker.publisher is not None
        self._publish = worker.publisher.publish
        self.batches: list[Any] = []
        worker.publisher.publish = self._hold  # type: ignore[method-assign]

    def _hold(self, events: Any, ts_s: float | None = None) -> int:
        self.batches.append(events)
        return 0

    def release(self) -> None:
        for batch in self.batches:
            self._publish(batch)
        self.batches.clear()


async def _complete(h: GatewayHarness, prompt: str) -> tuple[int, int]:
    """(predicted, reported) cached tokens of one request."""
    status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
    assert status == 200, body
    reported = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(headers["x-kvgate-predicted-cached-tokens"]), reported


def _counter(h: GatewayHarness, name: str) -> int:
    return h.gw.indexes["m"].stats().counters[name]


@pytest.mark.integration
async def test_back_to_back_shared_prefix_predicts_pending_blocks(worker):
    clock = Clock()
    config = make_config([worker], models=[{"name": "m", "block_size": BLOCK_SIZE, "pending_blocks_ttl_s": TTL_S}])
    async with GatewayHarness(config, clock=clock, workers=[worker]) as h:
        held = HeldEvents(worker)
        assert await _complete(h, SHARED + "aaaaaa") == (0, 0)  # 46 tokens: 11 full blocks pending
        assert h.gw.indexes["m"].stats().num_approx_blocks == 11
        assert await _complete(h, SHARED + "bbbbbb") == (40, 40)  # before any event: the shared 10 blocks
        assert _counter(h, "num_blocks_stored") == 0 and len(held.batches) == 2
        assert h.gw.proxy.num_honesty_mismatches == 0

        held.release()  # A's 11 blocks, then B's one new block: all 12 pending blocks confirmed
        await wait_until(lambda: _counter(h, "num_approx_blocks_confirmed") == 12)
        assert h.gw.indexes["m"].stats().num_approx_blocks == 0
        clock.now_s += 10 * TTL_S
        assert h.gw.indexes["m"].expire(clock.now_s) == 0  # confirmed blocks stop expiring
        held = HeldEvents(worker)
        assert await _complete(h, SHARED + "aaaaaac") == (44, 44)
        assert h.gw.proxy.num_honesty_mismatches == 0


@pytest.mark.integration
async def test_a_request_queued_behind_a_pending_shared_prefix_is_priced_for_its_own_blocks_only(worker):
    """A (46 tokens) and B (its first 40 tokens, then 6 of its own) wait at the worker before its first byte, with
    every KV event held back: B's prediction covers A's pending blocks, so the queue lists B's 6 uncached tokens,
    not 46, and a third request's queue term counts the shared prefix once (the cost model's rates are powers of
    two: every value is exact). The worker reports what was predicted."""
    policy = {"name": "cache_aware", "prefill_linear_tokens_per_s": 1024.0,
              "prefill_quadratic_tokens_sq_per_s": float(2**20), "per_running_request_s": 0.0,
              "per_waiting_request_s": 0.0, "enable_calibration": False}
    config = make_config([worker], policy=policy,
                         models=[{"name": "m", "block_size": BLOCK_SIZE, "pending_blocks_ttl_s": TTL_S}])
    async with GatewayHarness(config, clock=Clock(), workers=[worker]) as h:
        HeldEvents(worker)
        worker.answer_release = asyncio.Event()
        stream = {"model": "m", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        held = []
        for i, prompt in enumerate((SHARED + "aaaaaa", SHARED + "bbbbbb", "unrelated prompt")):
            held.append(asyncio.create_task(h.post("/v1/completions", {**stream, "prompt": prompt})))
            await wait_until(lambda i=i: worker.num_active == i + 1)
        runtime = h.gw.fleet.workers["w0"]
        # (admitted_at_s, uncached tokens, n**2 - k**2): A from scratch, B past the 40 tokens A computes
        assert list(runtime.pending_prefills.values())[:2] == [(1000.0, 46, 46 * 46), (1000.0, 6, 46 * 46 - 40 * 40)]
        third = h.gw.router.recent[-1]
        assert third.cost_terms()["w0"]["queue_s"] == (46 + 6) / 1024 + (46 * 46 + (46 * 46 - 40 * 40)) / 2**20
        worker.answer_release.set()
        answers = [await task for task in held]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert [a[1]["x-kvgate-predicted-cached-tokens"] for a in answers[:2]] == ["0", "40"]
        assert [_reported_cached_tokens(a[2]) for a in answers[:2]] == [0, 40]
        assert h.gw.proxy.num_honesty_mismatches == 0


def _reported_cached_tokens(stream: bytes) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of an SSE answer."""
    for line in stream.decode().splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            return int(json.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"])
    raise AssertionError("no usage in the stream")


@pytest.mark.integration
async def test_unconfirmed_pending_blocks_expire_after_ttl(worker):
    clock = Clock()
    config = make_config([worker], models=[{"name": "m", "block_size": BLOCK_SIZE, "pending_blocks_ttl_s": TTL_S}])
    async with GatewayHarness(config, clock=clock, workers=[worker]) as h:
        HeldEvents(worker)  # never released
        await _complete(h, SHARED + "aaaaaa")
        index = h.gw.indexes["m"]
        clock.now_s += TTL_S - 0.5
        assert index.expire(clock.now_s) == 0
        clock.now_s += 0.5
        assert index.expire(clock.now_s) == 11
        assert index.match([]).workers == {} and index.stats().num_approx_blocks == 0


@pytest.mark.integration
async def test_worker_block_size_limits_pending_to_its_full_blocks():
    """Worker blocks of 8 tokens, index blocks of 4: a 46-token prompt leaves 5 worker blocks = 10 index blocks."""
    w = FakeWorker("w0", block_size=8)
    await w.start()
    try:
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "models": [{"name": "m", "block_size": BLOCK_SIZE}],
            "workers": [{"id": "w0", "url": w.url, "model": "m", "events_endpoint": w.events_endpoint,
                         "load_path": None, "snapshot_path": None, "block_size": 8}],
            "health": {"interval_s": 3600},
            "admin": {"disable_auth": True},
        })
        async with GatewayHarness(config, clock=Clock(), workers=[w]) as h:
            HeldEvents(w)
            assert await _complete(h, SHARED + "aaaaaa") == (0, 0)
            assert h.gw.indexes["m"].stats().num_approx_blocks == 10
            assert await _complete(h, SHARED + "aaaaaabbbbbb") == (40, 40)
    finally:
        await w.stop()


@pytest.mark.integration
async def test_disabled_leaves_the_race(worker):
    config = make_config([worker], models=[{"name": "m", "block_size": BLOCK_SIZE, "enable_pending_blocks": False}])
    async with GatewayHarness(config, clock=Clock(), workers=[worker]) as h:
        HeldEvents(worker)
        assert await _complete(h, SHARED + "aaaaaa") == (0, 0)
        assert await _complete(h, SHARED + "bbbbbb") == (0, 40)
        assert h.gw.indexes["m"].stats().num_approx_blocks == 0


@pytest.mark.unit
def test_config_rejects_non_positive_ttl():
    with pytest.raises(ConfigError, match="pending_blocks_ttl_s"):
        parse_config({"models": [{"name": "m", "pending_blocks_ttl_s": 0}]})


@pytest.mark.integration
async def test_a_huge_prompt_inserts_only_its_first_max_routed_blocks(worker):
    """``max_routed_blocks`` bounds one decision's insertion (and so its time on the event loop): the first blocks
    are pending, a request behind predicts them, the rest waits for the worker's events."""
    config = make_config([worker], models=[{"name": "m", "block_size": BLOCK_SIZE, "max_routed_blocks": 6}])
    async with GatewayHarness(config, workers=[worker]) as h:
        held = HeldEvents(worker)
        assert await _complete(h, SHARED + "aaaaaa") == (0, 0)  # 11 full blocks; 6 inserted
        assert h.gw.indexes["m"].stats().num_approx_blocks == 6
        assert await _complete(h, SHARED + "bbbbbb") == (24, 40)  # predicted: the 6 pending blocks (the rest: late)
        assert h.gw.indexes["m"].stats().num_approx_blocks == 6  # the same first 6 blocks, refreshed
        held.release()
        await wait_until(lambda: _counter(h, "num_blocks_stored") >= 12)
        assert await _complete(h, SHARED + "cccccc") == (40, 40)  # the events know all 10 shared blocks


def test_config_rejects_non_positive_max_routed_blocks():
    with pytest.raises(ConfigError):
        parse_config({"models": [{"name": "m", "max_routed_blocks": 0}]})
