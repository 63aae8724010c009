"""Failure paths against real sim workers: health thresholds, the circuit breaker, the bind topology, resync."""

from __future__ import annotations

import logging

import pytest

from tests.router.sim_fleet import (
    BLOCK_SIZE,
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
from tests.router.test_with_sim_workers import PREFIX, direct

pytestmark = [pytest.mark.integration]


async def test_health_check_failure_and_success_thresholds():
    async with running(SimWorker("w0"), SimWorker("w1")) as ws:
        config = make_config(ws, health={"interval_s": 3600, "failure_threshold": 3, "success_threshold": 2})
        async with Gw(config) as g:
            fleet = g.gw.fleet
            w0 = fleet.workers["w0"]
            await fleet.check_health_once()
            await ws[0].stop()
            # (the background loop's own first check may land in between: count from the worker's tally)
            while w0.is_healthy:
                assert w0._num_health_failures < 3
                await fleet.check_health_once()
            assert w0._num_health_failures == 3  # unhealthy exactly at the third consecutive failure
            assert (await g.complete("where to?"))[0] == "w1"
            await ws[0].start()
            await fleet.check_health_once()
            assert not w0.is_healthy  # one success is not enough
            await fleet.check_health_once()
            assert w0.is_healthy  # healthy again at the second consecutive success
            assert fleet.workers["w1"].is_healthy


async def test_circuit_breaker_opens_half_opens_and_closes(caplog: pytest.LogCaptureFixture):
    clock = Clock()
    async with running(SimWorker("w0"), SimWorker("w1")) as ws:
        config = make_config(ws, circuit_breaker={"failure_threshold": 2, "open_s": 30})
        async with Gw(config, clock=clock) as g:
            await connected(g, ws)
            breaker = g.gw.fleet.workers["w0"].breaker
            await ws[0].stop()
            n = 0

            async def fresh() -> tuple[str, str]:
                nonlocal n
                n += 1
                status, headers, _ = await g.post("/v1/completions", {"model": "m", "prompt": f"{n} fresh prompt"})
                assert status == 200
                return headers["x-kvgate-worker"], headers["x-kvgate-decision"]

            # ties go to w0 (configuration order); it refuses connections: each request is retried on w1
            with caplog.at_level(logging.WARNING, logger="router.fleet"):
                assert [await fresh() for _ in range(2)] == [("w1", "retry"), ("w1", "retry")]
            assert breaker.state.name == "OPEN"
            assert "worker w0: circuit opened after 2 consecutive failures" in caplog.messages
            assert (await fresh()) == ("w1", "min_ttft")  # open: w0 is not a candidate at all
            clock.offset_s += 31  # half-open: one trial request, which fails: open again
            assert (await fresh()) == ("w1", "retry")
            assert breaker.state.name == "OPEN"
            await ws[0].start()
            clock.offset_s += 31  # half-open again; the trial succeeds: closed
            assert (await fresh())[0] == "w0"
            assert breaker.state.name == "CLOSED"
            async with g.session.get(g.url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvgate_circuit_state{worker="w0"} 0.0' in text


async def test_bind_topology_one_sub_for_every_worker():
    """The gateway binds one SUB; each worker's PUB connects to it with topic kv@<worker>@m."""
    ws = [SimWorker(f"b{i}", connect_to="(set once the gateway is bound)") for i in range(2)]
    config = make_config(ws, events={"bind_endpoint": "tcp://127.0.0.1:*"})
    async with Gw(config) as g:
        bound = g.gw.subscriber.bound_endpoint
        assert bound is not None and bound.startswith("tcp://127.0.0.1:")
        for w in ws:
            w.connect_to = bound
        async with running(*ws):
            await connected(g, ws)
            await direct(ws[1], PREFIX)
            await direct(ws[0], PREFIX[: 4 * BLOCK_SIZE])
            await in_sync(g.gw, ws)
            assert (num_indexed_blocks(g.gw, "b0"), num_indexed_blocks(g.gw, "b1")) == (4, 10)
            assert await g.complete(PREFIX) == ("b1", 9 * BLOCK_SIZE, 9 * BLOCK_SIZE)
            assert g.gw.proxy.num_honesty_mismatches == 0


async def test_gap_without_replay_resyncs_and_rebuilds_from_the_snapshot():
    async with running(SimWorker("w0", with_replay=False), SimWorker("w1")) as ws:
        w0 = ws[0]
        async with Gw(make_config(ws)) as g:
            await connected(g, ws)
            await direct(w0, PREFIX)
            await in_sync(g.gw, ws)
            # one batch lost on the wire: the publisher skips a seq (nothing to replay it from)
            w0.publisher._next_seq += 1
            await direct(w0, "g" * 64)
            counters = g.gw.subscriber.counters
            await wait_until(lambda: counters.resyncs[("w0", "gap_no_replay")] == 1, what="resync")
            await wait_until(lambda: g.gw.fleet.workers["w0"].is_warm, what="warm again")
            await in_sync(g.gw, ws)
            assert num_indexed_blocks(g.gw, "w0") == worker_blocks(w0) == 14
            assert await g.complete(PREFIX + "!") == ("w0", 10 * BLOCK_SIZE, 10 * BLOCK_SIZE)
