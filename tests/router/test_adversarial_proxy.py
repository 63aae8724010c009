"""The request path under abuse: clients that go away at every stage, fleets that change while requests wait, and
request fields the gateway cannot predict a cache hit for. Every client gets an exact status and, for errors, an
OpenAI-style JSON body; the in-flight counters and admission slots return to exactly 0.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from router.app import Gateway
from router.fleet import CircuitState
from tests.router.harness import Clock, GatewayHarness, make_config, wait_until
from tests.router.sim_fleet import Gw, SimWorker, connected, running
from tests.router.sim_fleet import make_config as sim_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def load_counters(gw: Gateway) -> dict[str, tuple[int, int, int, int]]:
    """Per worker: (requests in flight, pending prefill tokens, prompt tokens in flight, decoding requests)."""
    return {w.worker_id: (w.num_inflight_requests, w.num_pending_prefill_tokens, w.num_inflight_prompt_tokens,
                          w.num_decoding_requests) for w in gw.fleet.workers.values()}


def is_idle(gw: Gateway) -> bool:
    return (gw.admission.num_inflight == 0 and gw.admission.num_waiting == 0
            and all(c == (0, 0, 0, 0) for c in load_counters(gw).values()))


async def test_a_half_open_trial_abandoned_by_its_client_lets_the_next_request_be_the_trial(workers):
    clock = Clock()
    config = make_config(workers, circuit_breaker={"failure_threshold": 1, "open_s": 30})
    async with GatewayHarness(config, clock=clock, workers=workers) as h:
        breaker = h.gw.fleet.workers["w0"].breaker
        workers[0].fail_statuses = [500]
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "first prompt"})
        assert (status, headers["x-kvgate-worker"], headers["x-kvgate-decision"]) == (200, "w1", "retry")
        assert breaker.state is CircuitState.OPEN
        clock.now_s += 31  # half-open: the next request to w0 is its trial; w0 holds it before the headers
        workers[0].answer_release = asyncio.Event()
        async with aiohttp.ClientSession() as s:
            trial = asyncio.create_task(s.post(h.url + "/v1/completions",
                                               json={"model": "m", "prompt": "second prompt", "stream": True}))
            await wait_until(lambda: workers[0].num_active == 1)
            assert (breaker.state, breaker.is_trial_in_flight) == (CircuitState.HALF_OPEN, True)
            trial.cancel()  # the client goes away while the trial waits for w0's headers
            with pytest.raises(asyncio.CancelledError):
                await trial
        await wait_until(lambda: is_idle(h.gw))
        # No verdict on w0: it stays half-open, and the next request may be the trial.
        assert (breaker.state, breaker.is_trial_in_flight) == (CircuitState.HALF_OPEN, False)
        workers[0].answer_release.set()
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "third prompt"})
        assert (status, headers["x-kvgate-worker"], headers["x-kvgate-decision"]) == (200, "w0", "min_ttft")
        assert breaker.state is CircuitState.CLOSED


async def test_a_worker_added_while_requests_wait_for_admission_takes_them(workers):
    w0, w1 = workers
    config = make_config([w0], admission={"max_inflight_per_worker": 1, "queue_timeout_s": 3.0})
    async with GatewayHarness(config, workers=[w0]) as h:
        w0.stream_release = asyncio.Event()
        held = await h.session.post(h.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await held.content.readline()
        waiting = asyncio.create_task(h.post("/v1/completions", {"model": "m", "prompt": "y"}))
        await wait_until(lambda: h.gw.admission.num_waiting == 1)
        status, _ = await h.admin("POST", "/admin/workers", {"id": "w1", "url": w1.url, "model": "m",
                                                             "events_endpoint": w1.events_endpoint})
        assert status == 201
        async with asyncio.timeout(1.0):  # well before the queue timeout (3 s)
            status, headers, body = await waiting
        assert (status, headers["x-kvgate-worker"]) == (200, "w1"), body
        w0.stream_release.set()
        await held.read()
        held.release()
        await wait_until(lambda: is_idle(h.gw))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m", "prompt": "hello", "n": 2}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}], "n": 3}),
        ("/v1/completions", {"model": "m", "prompt": "hello", "n": 0}),
    ],
)
async def test_n_other_than_1_is_refused_before_any_worker_sees_it(workers, path, body):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        status, headers, raw = await h.post(path, body)
        assert (status, headers["Content-Type"]) == (400, "application/json")
        assert json.loads(raw) == {"error": {
            "message": f"only n=1 is supported, got n={body['n']}", "type": "invalid_request_error",
            "param": "n", "code": None}}
        assert workers[0].requests == [] and workers[1].requests == []
        for n in (1, None):  # the default, given explicitly
            status, headers, _ = await h.post(path, {**body, "n": n})
            assert status == 200
        assert is_idle(h.gw)


async def test_a_request_abandoned_while_queued_on_its_worker_leaves_no_pending_blocks_behind():
    """The client of a streamed request queued on its worker leaves after the headers, before the first chunk: the
    worker drops it without caching a block, so the pending entries its routing inserted are withdrawn; the same
    prompt next predicts exactly what the worker reports (0), not the abandoned request's blocks."""
    w0 = SimWorker("w0", time_scale=1.0, timing={"step-overhead-s": 0.05})
    w0.raw["scheduler"]["max-num-seqs"] = 1  # one request at a time: the next waits in the worker's queue
    async with running(w0) as ws, Gw(sim_config(ws)) as g:
        await connected(g, ws)
        runtime = g.gw.fleet.workers["w0"]
        assert g.session is not None
        blocker = await g.session.post(g.url + "/v1/completions", json={
            "model": "m", "prompt": "blocker " * 4, "max_tokens": 20, "stream": True})
        await blocker.content.readline()
        prompt = "the abandoned prompt " * 8  # 168 byte-level tokens: 10 full blocks of 16
        async with aiohttp.ClientSession() as s:
            abandoned = await s.post(g.url + "/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 2, "stream": True})
            assert abandoned.status == 200  # the worker's headers: they come before its prefill
            assert runtime.num_inflight_requests == 2 and runtime.num_decoding_requests == 1
            abandoned.close()  # the client leaves before the first chunk
        await wait_until(lambda: runtime.num_inflight_requests == 1)
        await blocker.read()
        blocker.release()
        assert await g.complete(prompt) == ("w0", 0, 0)
        assert g.gw.proxy.num_honesty_mismatches == 0
        assert is_idle(g.gw)
