"""Proxy behaviour on the mock transport: retries, disconnects, bad input, overload, admin, calibration, and the
request path under abuse (clients that go away, fleets that change while requests wait, fields the gateway cannot
predict for), with ``MockWorker``s answering in memory (no socket to a worker; the client still talks HTTP to
the gateway on loopback, and KV events still travel over real ZMQ).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from router.fleet import CircuitState
from tests.router.harness import Clock, is_idle, make_config, wait_until
from tests.router.mock_workers import MockGatewayHarness, MockWorker

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


@pytest.fixture
async def workers() -> AsyncIterator[list[MockWorker]]:
    """Two mock workers, ``w0`` and ``w1``."""
    ws = [MockWorker("w0"), MockWorker("w1")]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        await w.stop()


async def test_retry_before_first_byte_never_after(workers):
    async with MockGatewayHarness(make_config(workers, policy={"name": "round_robin"}), workers=workers) as h:
        workers[0].fail_statuses = [503]
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hi"},
                                          headers={"x-kvgate-worker": "w0"})
        # forced worker has no alternative: the 503 is relayed after the only attempt
        assert status == 503 and headers["x-kvgate-worker"] == "w0"
        workers[0].fail_statuses = [500]
        workers[1].fail_statuses = []
        results = []
        for _ in range(2):
            status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hi"})
            results.append((status, headers["x-kvgate-worker"]))
        assert all(s == 200 for s, _ in results)
        assert len(workers[0].requests) == 2 and len(workers[1].requests) == 2
        # a worker that is down: connect error -> next worker
        await workers[0].stop()
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hey"})
        status2, headers2, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hey"})
        assert (status, status2) == (200, 200)
        assert headers["x-kvgate-worker"] == headers2["x-kvgate-worker"] == "w1"


async def test_client_disconnect_releases_load_and_cancels_upstream(workers):
    async with MockGatewayHarness(make_config(workers), workers=workers) as h:
        workers[0].stream_release = asyncio.Event()
        w0 = h.gw.fleet.workers["w0"]
        async with aiohttp.ClientSession() as s:
            r = await s.post(h.url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True},
                             headers={"x-kvgate-worker": "w0"})
            await r.content.readline()
            assert w0.num_inflight_requests == 1 and w0.num_decoding_requests == 1
            assert w0.num_inflight_prompt_tokens == 2  # "hi", byte-level tokens
            r.close()
        await wait_until(lambda: w0.num_inflight_requests == 0 and h.gw.admission.num_inflight == 0)
        await wait_until(lambda: workers[0].num_cancelled == 1)
        assert w0.num_decoding_requests == 0 and w0.num_pending_prefill_tokens == 0
        assert w0.num_inflight_prompt_tokens == 0


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"model": "m", "prompt": 5}', 400, "prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": ""}', 400, "prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": "a"}', 400, "max_tokens"),
        ("/v1/chat/completions", b'{"model": "m", "messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"content": "x"}]}', 400, "messages"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'{"model": "m", "prompt": "' + b"x" * 2048 + b'"}', 413, None),
    ],
)
async def test_bad_input_gets_openai_error(workers, path, raw, status, param):
    config = make_config(workers, listen={"max_body_bytes": 1024})
    async with MockGatewayHarness(config, workers=workers) as h:
        got, headers, body = await h.post(path, None, raw=raw, headers={"Content-Type": "application/json"})
        assert got == status
        err = json.loads(body)["error"]
        assert err["param"] == param and err["message"]
        assert h.gw.admission.num_inflight == 0
        assert not workers[0].requests and not workers[1].requests


async def test_no_worker_503_and_overload_429(workers):
    async with MockGatewayHarness(make_config(workers), workers=workers) as h:
        for w in h.gw.fleet.workers.values():
            w.is_healthy = False
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
    config = make_config(workers, admission={"max_inflight_requests": 1, "queue_size": 0})
    async with MockGatewayHarness(config, workers=workers) as h:
        workers[0].stream_release = asyncio.Event()
        r = await h.session.post(h.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                                 headers={"x-kvgate-worker": "w0"})
        await r.content.readline()
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 429 and headers["Retry-After"] == "1"
        workers[0].stream_release.set()
        await r.read()
        r.release()
    # Per-worker limit with the only other worker drained: its free slots are no room, so overload is a 429.
    config = make_config(workers[:2], admission={"max_inflight_per_worker": 1, "queue_size": 0})
    async with MockGatewayHarness(config, workers=workers[:2]) as h:
        await h.admin("POST", "/admin/workers/w1/drain")
        workers[0].stream_release = asyncio.Event()
        r = await h.session.post(h.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await r.content.readline()
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert (status, headers.get("Retry-After")) == (429, "1"), body
        workers[0].stream_release.set()
        await r.read()
        r.release()
        # A forced worker obeys the drain too: refused with a reason, never sent the request.
        num_requests = len(workers[1].requests)
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": "x"},
                                       headers={"x-kvgate-worker": "w1"})
        error = json.loads(body)["error"]
        assert status == 503 and error["message"] == "forced worker 'w1' cannot take requests now: draining"
        assert len(workers[1].requests) == num_requests


async def test_per_worker_limit_with_every_worker_drained_is_a_503_at_once_and_undrain_wakes_waiters(workers):
    config = make_config(workers[:2], admission={"max_inflight_per_worker": 1, "queue_timeout_s": 5.0})
    async with MockGatewayHarness(config, workers=workers[:2]) as h:
        for w in ("w0", "w1"):
            assert (await h.admin("POST", f"/admin/workers/{w}/drain"))[0] == 200
        t0 = time.monotonic()
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert time.monotonic() - t0 < 1.0  # no wait in the queue: nothing to wait for
        error = json.loads(body)["error"]
        assert (status, headers["Retry-After"], error["code"]) == (503, "1", "all_workers_draining")
        assert error["message"] == "no worker available for model 'm': all_workers_draining"
        # w0 undrained and full (a held stream), w1 still drained: a request waits; undraining w1 lets it in.
        assert (await h.admin("POST", "/admin/workers/w0/undrain"))[0] == 200
        workers[0].stream_release = asyncio.Event()
        held = await h.session.post(h.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await held.content.readline()
        waiting = asyncio.create_task(h.post("/v1/completions", {"model": "m", "prompt": "y"}))
        await wait_until(lambda: h.gw.admission.num_waiting == 1)
        t0 = time.monotonic()
        assert (await h.admin("POST", "/admin/workers/w1/undrain"))[0] == 200
        status, headers, _ = await waiting
        assert (status, headers["x-kvgate-worker"]) == (200, "w1") and time.monotonic() - t0 < 1.0
        workers[0].stream_release.set()
        await held.read()
        held.release()


async def test_admin_auth_and_policy_hot_reload(workers):
    async with MockGatewayHarness(make_config(workers), workers=workers) as h:
        assert (await h.admin("GET", "/admin/workers", token=None))[0] == 401
        assert (await h.admin("GET", "/admin/workers", token="wrong"))[0] == 401
        status, body = await h.admin("GET", "/admin/workers")
        assert status == 200 and [w["id"] for w in body["workers"]] == ["w0", "w1"]
        status, body = await h.admin("PUT", "/admin/policy", raw=b'{"name": "cache_aware", "temperature": -1}')
        assert status == 400 and "temperature" in body["error"]["message"]
        assert h.gw.holder.policy.name == "cache_aware"
        status, body = await h.admin("PUT", "/admin/policy", raw=b'{"name": "bogus"}')
        assert status == 400 and h.gw.holder.policy.name == "cache_aware"
        status, body = await h.admin("PUT", "/admin/policy", raw=b'{"name": "round_robin"}')
        assert status == 200 and h.gw.holder.policy.name == "round_robin"
        seen = []
        for _ in range(4):
            _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "same"})
            seen.append(headers["x-kvgate-worker"])
        assert seen in (["w0", "w1", "w0", "w1"], ["w1", "w0", "w1", "w0"])
        status, body = await h.admin("GET", "/admin/decisions?limit=2")
        assert status == 200 and len(body["decisions"]) == 2
        assert set(body["decisions"][0]["cached_tokens"]) == {"w0", "w1"}
        assert all(0.0 <= d["age_s"] < 60.0 for d in body["decisions"])
        # GET's answer goes back to PUT as is (the policy under "policy").
        status, body = await h.admin("PUT", "/admin/policy", raw=b'{"policy": {"name": "least_loaded"}}')
        assert status == 200 and h.gw.holder.policy.name == "least_loaded"
        status, got = await h.admin("GET", "/admin/policy")
        status, body = await h.admin("PUT", "/admin/policy", got)
        assert status == 200 and body["policy"] == got["policy"] and h.gw.holder.policy.name == "least_loaded"
        status, body = await h.admin("POST", "/admin/workers",
                                     {"id": "w9", "url": "http://127.0.0.1:1", "model": "m"})
        assert status == 201 and body["id"] == "w9"
        status, body = await h.admin("POST", "/admin/workers", {"id": "w9", "url": "ftp://x", "model": "m"})
        assert status == 400
        assert (await h.admin("DELETE", "/admin/workers/nope"))[0] == 404


async def test_a_ttft_decided_by_a_replaced_policy_never_calibrates_the_new_one(workers):
    """The TTFT of a request decided by ``least_loaded`` (scores: request counts) arrives after ``cache_aware``
    replaced it: the new policy's calibrator learns nothing from it; a request it decided itself calibrates it."""
    async with MockGatewayHarness(make_config(workers, policy={"name": "least_loaded"}), workers=workers) as h:
        release = asyncio.Event()
        for w in workers:
            w.answer_release = release  # streams answer (headers, then chunks) once released
        body = {"model": "m", "prompt": "x" * 400, "stream": True}
        pending = []
        for i in range(4):  # least_loaded's scores are request counts: the last two are decided with 1.0
            pending.append(asyncio.create_task(h.post("/v1/completions", body)))
            await wait_until(lambda i=i: workers[0].num_active + workers[1].num_active == i + 1)
        status, _ = await h.admin("PUT", "/admin/policy", {"name": "cache_aware", "min_calibration_work_s": 0.0})
        assert status == 200
        calibrator = h.gw.router.holder.calibrator
        assert calibrator is not None
        release.set()
        assert [(await p)[0] for p in pending] == [200] * 4
        assert calibrator.num_observations == 0 and calibrator.speed_factors() == {}
        status, _, _ = await h.post("/v1/completions", body)
        assert status == 200 and calibrator.num_observations == 1



async def test_a_half_open_trial_abandoned_by_its_client_lets_the_next_request_be_the_trial(workers):
    clock = Clock()
    config = make_config(workers, circuit_breaker={"failure_threshold": 1, "open_s": 30})
    async with MockGatewayHarness(config, clock=clock, workers=workers) as h:
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
    async with MockGatewayHarness(config, workers=[w0], reachable=workers) as h:
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
    async with MockGatewayHarness(make_config(workers), workers=workers) as h:
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
