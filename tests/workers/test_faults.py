"""Fault injection on the reference worker (``workers.faults``, ``POST /debug/faults``) and the process surfaces
it shares with the gateway (``/metrics`` process series, ``/debug/memory``)."""

from __future__ import annotations

import time

import aiohttp
import pytest
import zmq

from benchmarks._probe import parse_metrics, total
from events.publisher import SEQ_END_MARKER, KVEventPublisher, PublisherConfig
from events.types import AllBlocksCleared
from tests.workers.conftest import make_config

pytestmark = pytest.mark.integration

PROMPT = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 2}


async def set_faults(session: aiohttp.ClientSession, url: str, **faults: object) -> dict[str, object]:
    async with session.post(url + "/debug/faults", json=faults) as resp:
        assert resp.status == 200
        return await resp.json()


async def test_fault_routes_exist_only_when_enabled(start_worker):
    plain = await start_worker()
    faulty = await start_worker(make_config(**{"enable-fault-injection": True}))
    async with aiohttp.ClientSession() as s:
        async with s.post(plain.base_url + "/debug/faults", json={"delay_s": 1.0}) as resp:
            assert resp.status in (404, 405)
        async with s.get(faulty.base_url + "/debug/faults") as resp:
            assert await resp.json() == {"delay_s": 0.0, "fail_after_headers": False, "drop_events": False,
                                         "refuse_replay": False}
        async with s.post(faulty.base_url + "/debug/faults", json={"delay_s": -1}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with s.post(faulty.base_url + "/debug/faults", json={"slow": True}) as resp:
            assert resp.status == 400


async def test_delay_and_fail_after_headers(start_worker):
    w = await start_worker(make_config(**{"enable-fault-injection": True}))
    async with aiohttp.ClientSession() as s:
        assert (await set_faults(s, w.base_url, delay_s=0.3))["delay_s"] == 0.3
        t0 = time.monotonic()
        async with s.post(w.base_url + "/v1/completions", json=PROMPT) as resp:
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 2
        assert time.monotonic() - t0 >= 0.3
        await set_faults(s, w.base_url, fail_after_headers=True)
        for stream in (True, False):
            async with s.post(w.base_url + "/v1/completions", json={**PROMPT, "stream": stream}) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
        await set_faults(s, w.base_url)
        async with s.post(w.base_url + "/v1/completions", json=PROMPT) as resp:
            assert resp.status == 200
    # The aborted requests never reached the scheduler: nothing runs, no block is held.
    assert w.worker.core.scheduler.num_running == 0 and w.worker.core.scheduler.num_waiting == 0


def test_publisher_drops_sends_keeps_replay_and_can_refuse_replay():
    ctx = zmq.Context()
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"),
                           context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    try:
        while True:  # slow joiner
            seq = pub.publish([AllBlocksCleared()])
            if sub.poll(20):
                break
        while sub.poll(100):
            sub.recv_multipart()
        pub.set_faults(drop_sends=True, refuse_replay=False)
        dropped = [pub.publish([AllBlocksCleared()]) for _ in range(2)]
        assert dropped == [seq + 1, seq + 2] and not sub.poll(200)
        pub.set_faults(drop_sends=False, refuse_replay=False)
        assert pub.publish([AllBlocksCleared()]) == seq + 3
        assert sub.poll(2000) and int.from_bytes(sub.recv_multipart()[1], "big") == seq + 3  # a gap of two
        dealer.send_multipart([b"", (seq + 1).to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(4)]
        assert [int.from_bytes(r[1], "big") for r in replies[:3]] == [seq + 1, seq + 2, seq + 3]
        assert replies[3][1] == SEQ_END_MARKER
        pub.set_faults(drop_sends=False, refuse_replay=True)
        dealer.send_multipart([b"", (seq + 1).to_bytes(8, "big")])
        assert not dealer.poll(500)
        pub.set_faults(drop_sends=False, refuse_replay=False)
        dealer.send_multipart([b"", (seq + 3).to_bytes(8, "big")])
        assert dealer.poll(2000) and int.from_bytes(dealer.recv_multipart()[1], "big") == seq + 3
    finally:
        dealer.close(linger=0)
        sub.close(linger=0)
        pub.close()
        ctx.term()


async def test_worker_metrics_and_debug_memory(start_worker):
    w = await start_worker()
    async with aiohttp.ClientSession() as s:
        async with s.get(w.base_url + "/metrics") as resp:
            metrics = parse_metrics(await resp.text())
        async with s.get(w.base_url + "/debug/memory") as resp:
            memory = await resp.json()
    assert total(metrics, "process_resident_memory_bytes") > 10 << 20
    assert total(metrics, "process_open_fds") > 0
    assert total(metrics, "kvgate_process_asyncio_tasks") >= 2  # the engine loop and this request's handler
    assert memory["is_tracing"] is False and memory["sites"] == []


async def test_worker_debug_memory_refuses_bad_params_by_name(start_worker):
    """A bad ``limit``, ``group_by``, ``trim`` or ``collect`` is a 400 naming it (as the gateway's
    ``/admin/debug/memory``); the accepted spellings still answer."""
    w = await start_worker()
    async with aiohttp.ClientSession() as s:
        for query, param, message in (
            ("group_by=0", "group_by", "group_by must be 'lineno' or 'traceback', got '0'"),
            ("group_by=LINENO", "group_by", "group_by must be 'lineno' or 'traceback', got 'LINENO'"),
            ("trim=maybe", "trim", "trim must be true or false, got 'maybe'"),
            ("trim=", "trim", "trim must be true or false, got ''"),
            ("limit=x", "limit", "limit must be an integer, got 'x'"),
            ("limit=3&trim=yes", "trim", "trim must be true or false, got 'yes'"),
            ("collect=2", "collect", "collect must be true or false, got '2'"),
        ):
            async with s.get(f"{w.base_url}/debug/memory?{query}") as resp:
                assert (resp.status, await resp.json()) == (400, {"error": {
                    "message": message, "type": "invalid_request_error", "param": param, "code": None}}), query
        for query in ("limit=0&group_by=traceback&trim=TRUE", "trim=0", "trim=1&group_by=lineno"):
            async with s.get(f"{w.base_url}/debug/memory?{query}") as resp:
                assert resp.status == 200, query
                body = await resp.json()
            assert body["sites"] == [] and isinstance(body["trimmed"], bool), query
            assert body["num_collected"] is None, query
        async with s.get(f"{w.base_url}/debug/memory?limit=0&collect=TRUE") as resp:
            assert resp.status == 200 and isinstance((await resp.json())["num_collected"], int)
        async with s.get(w.base_url + "/metrics") as resp:
            metrics = parse_metrics(await resp.text())
    assert total(metrics, "kvgate_worker_bad_requests_total") == 7
