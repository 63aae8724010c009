"""Proxy behaviour end to end: passthrough, retries, disconnects, bad input, admin, the openai client."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from tests.router.harness import GatewayHarness, make_config, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_streaming_passthrough_byte_exact_and_honest(workers):
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 50}], "stream": True}
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # the second answer is what a warm worker sends
                async with s.post(workers[0].url + "/v1/chat/completions", json=body) as r:
                    direct = await r.read()
        await wait_until(lambda: h.gw.subscriber.last_seq("w0") == workers[0].publisher.next_seq - 1)
        _, headers, via = await h.post("/v1/chat/completions", body, headers={"x-kvgate-worker": "w0"})
        assert via == direct
        assert headers["Content-Type"].startswith("text/event-stream")
        # multi-turn conversation: predicted == reported on every turn
        messages = [{"role": "system", "content": "sys " * 20}]
        for turn in range(5):
            messages.append({"role": "user", "content": f"question {turn} " * 7})
            _, headers, raw = await h.post("/v1/chat/completions", {"model": "m", "messages": messages,
                                                                   "stream": turn % 2 == 0})
            messages.append({"role": "assistant", "content": "ok"})
            served = next(w for w in workers if w.worker_id == headers["x-kvgate-worker"])
            # the next turn is routed after this turn's BlockStored reached the index
            await wait_until(lambda w=served: h.gw.subscriber.last_seq(w.worker_id) == w.publisher.next_seq - 1)
        assert h.gw.proxy.num_honesty_checks == 6
        assert h.gw.proxy.num_honesty_mismatches == 0
        text = (await (await h.session.get(h.url + "/metrics")).read()).decode()
        assert 'kvgate_cached_tokens_checks_total{result="match",worker=' in text


async def test_retry_before_first_byte_never_after(workers):
    async with GatewayHarness(make_config(workers, policy={"name": "round_robin"}), workers=workers) as h:
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


async def test_stream_break_after_first_byte_is_not_retried(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        workers[0].stream_release = asyncio.Event()
        body = {"model": "m", "prompt": "hello there", "stream": True}
        async with h.session.post(h.url + "/v1/completions", json=body, headers={"x-kvgate-worker": "w0"}) as r:
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            await workers[0].stop()  # the worker dies mid-stream
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
        assert len(workers[1].requests) == 0
        await wait_until(lambda: h.gw.fleet.workers["w0"].num_inflight_requests == 0)


async def test_client_disconnect_releases_load_and_cancels_upstream(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
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
    async with GatewayHarness(config, workers=workers) as h:
        got, headers, body = await h.post(path, None, raw=raw, headers={"Content-Type": "application/json"})
        assert got == status
        err = json.loads(body)["error"]
        assert err["param"] == param and err["message"]
        assert h.gw.admission.num_inflight == 0
        assert not workers[0].requests and not workers[1].requests


async def test_no_worker_503_and_overload_429(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        for w in h.gw.fleet.workers.values():
            w.is_healthy = False
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
    config = make_config(workers, admission={"max_inflight_requests": 1, "queue_size": 0})
    async with GatewayHarness(config, workers=workers) as h:
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
    async with GatewayHarness(config, workers=workers[:2]) as h:
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
    async with GatewayHarness(config, workers=workers[:2]) as h:
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
    async with GatewayHarness(make_config(workers), workers=workers) as h:
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


async def test_openai_client_against_gateway(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["m"]
            resp = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=2)
            assert resp.usage is not None and resp.usage.prompt_tokens > 0
            stream = await client.completions.create(model="m", prompt="hello", stream=True, max_tokens=2)
            chunks = [c async for c in stream]
            assert [c.choices[0].text for c in chunks if c.choices] == ["t0", "t1"]
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="other", prompt="x")
        finally:
            await client.close()


async def test_worker_sees_the_client_headers_and_nothing_the_http_client_adds(workers):
    body = {"model": "m", "prompt": "hi"}
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        async with aiohttp.ClientSession(skip_auto_headers=("User-Agent", "Accept-Encoding")) as s:
            request_ids = []
            for _ in range(2):  # byte-identical header blocks: the second is read from the memo
                async with s.post(h.url + "/v1/completions", json=body,
                                  headers={"x-kvgate-worker": "w0", "Authorization": "Bearer k"}) as r:
                    assert r.status == 200
                    request_ids.append(r.headers["x-request-id"])
        assert request_ids[0] != request_ids[1]
        forwarded = [[v for k, v in req["headers"].items() if k.lower() == "x-request-id"]
                     for req in workers[0].requests[-2:]]
        assert forwarded == [[request_ids[0]], [request_ids[1]]]
        request_id = request_ids[1]
        sent = {k.lower(): v for k, v in workers[0].requests[-1]["headers"].items()}
        assert "user-agent" not in sent
        assert "accept-encoding" not in sent
        assert sent["authorization"] == "Bearer k"
        assert sent["content-type"] == "application/json"
        assert sent["x-request-id"] == request_id
        assert sent["host"] == workers[0].url.removeprefix("http://")
        # a client that sends them gets them through unchanged
        _, _, _ = await h.post("/v1/completions", body, headers={"x-kvgate-worker": "w0", "User-Agent": "agent/1",
                                                                 "Accept-Encoding": "identity"})
        sent = {k.lower(): v for k, v in workers[0].requests[-1]["headers"].items()}
        assert sent["user-agent"] == "agent/1"
        assert sent["accept-encoding"] == "identity"
        # The client's own request id is kept end to end: forwarded once, echoed, and on the gateway's own errors.
        _, headers, _ = await h.post("/v1/completions", body, headers={"x-kvgate-worker": "w0",
                                                                       "X-Request-Id": "my-trace-123"})
        assert {k.lower(): v for k, v in headers.items()}["x-request-id"] == "my-trace-123"
        assert [v for k, v in workers[0].requests[-1]["headers"].items() if k.lower() == "x-request-id"] == [
            "my-trace-123"]
        status, headers, _ = await h.post("/v1/completions", {"model": "nope", "prompt": "hi"},
                                          headers={"X-Request-Id": "my-trace-124"})
        assert (status, {k.lower(): v for k, v in headers.items()}["x-request-id"]) == (404, "my-trace-124")
        status, headers, _ = await h.post("/v1/completions", {"model": "nope", "prompt": "hi"})
        assert status == 404 and {k.lower(): v for k, v in headers.items()}["x-request-id"].startswith("kvg-")


async def test_removing_a_worker_lets_its_streams_finish(workers):
    async with GatewayHarness(make_config(workers[:2]), workers=workers[:2]) as h:
        workers[0].stream_release = asyncio.Event()
        r = await h.session.post(h.url + "/v1/completions", json={"model": "m", "prompt": "x" * 40, "stream": True},
                                 headers={"x-kvgate-worker": "w0"})
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        status, _ = await h.admin("DELETE", "/admin/workers/w0")
        assert status == 200 and "w0" not in h.gw.fleet.workers
        workers[0].stream_release.set()  # the worker finishes its stream after the removal
        rest = await asyncio.wait_for(r.read(), timeout=10)
        r.release()
        assert rest.endswith(b"data: [DONE]\n\n") and b'"usage"' in rest  # relayed to its end, not cut or hung
        transport = h.gw.transport
        await wait_until(lambda: not transport._retired)  # type: ignore[attr-defined]  # the removed pool closed
        # The fleet goes on without it.
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "y"})
        assert (status, headers["x-kvgate-worker"]) == (200, "w1")


async def test_a_ttft_decided_by_a_replaced_policy_never_calibrates_the_new_one(workers):
    """The TTFT of a request decided by ``least_loaded`` (scores: request counts) arrives after ``cache_aware``
    replaced it: the new policy's calibrator learns nothing from it; a request it decided itself calibrates it."""
    async with GatewayHarness(make_config(workers, policy={"name": "least_loaded"}), workers=workers) as h:
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
