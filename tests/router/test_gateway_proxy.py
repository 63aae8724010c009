"""Proxy behaviour end to end: passthrough, retries, disconnects, bad input, admin, the openai client."""

from __future__ import annotations

import asyncio

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


async def test_stream_break_after_first_byte_is_not_retried(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        workers[0].stream_release = asyncio.Event()
        body = {"model": "m", "prompt": "hello there", "stream": True}
        async with h.session.post(h.url + "/v1/completions", json=body, headers={"x-kvgate-worker": "w0"}) as r:
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            await workers[0].stop()  # the worker dies mid-stream
            rest = await r.read()  # the stream ends cleanly, with an OpenAI error event and [DONE]
        assert rest.startswith(b'\ndata: {"error":{"message":"the worker\'s answer broke after its headers: ')
        assert rest.endswith(b'"type":"upstream_error","param":null,"code":"upstream_error"}}\n\ndata: [DONE]\n\n')
        assert len(workers[1].requests) == 0
        await wait_until(lambda: h.gw.fleet.workers["w0"].num_inflight_requests == 0)
        assert h.gw.fleet.workers["w0"].breaker.num_consecutive_failures == 1


@pytest.mark.parametrize(("cut", "relayed"), [
    # Half an event after a whole one: the whole one is relayed, the half dropped, the error event follows.
    (b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choi', b'data: {"choices":[{"text":"a"}]}\n\n'),
    (b'data: {"choices":[{"text":"a"}]}\r\n\r\ndata: {', b'data: {"choices":[{"text":"a"}]}\r\n\r\n'),
    (b'data: {"choi', b""),  # nothing whole came
])
async def test_a_stream_cut_inside_an_event_ends_after_its_last_whole_event(workers, cut, relayed):
    workers[0].stream_cut = cut
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        body = {"model": "m", "prompt": "hello there", "stream": True}
        async with h.session.post(h.url + "/v1/completions", json=body, headers={"x-kvgate-worker": "w0"}) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.startswith(relayed + b'data: {"error":{"message":"the worker\'s answer broke after its headers: ')
        assert raw.endswith(b'"code":"upstream_error"}}\n\ndata: [DONE]\n\n') and raw.count(b"data: ") == (
            relayed.count(b"data: ") + 2)
        text = (await (await h.session.get(h.url + "/metrics")).read()).decode()
        assert 'kvgate_stream_errors_total{worker="w0"} 1.0' in text
        assert 'kvgate_stream_errors_total{worker="w1"} 0.0' in text


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
