"""Hostile clients and a misbehaving prefill worker on the disaggregated path (real sim workers, real HTTP on
loopback, a small aiohttp fake where a worker must answer what no sim worker answers): the client's own PD fields
never steer a pull, a prefill worker's refusal reaches the client with its own status, unusable handshake params
from a prefill worker are that worker's failure, and a request no decode worker can ever hold is refused at once;
each time nothing stays reserved, waiting or admitted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.worker_config import decode_worker
from tests.ports import free_port
from tests.router.sim_fleet import MODEL, Gw, connected, running, wait_until
from tests.router.test_pd_gateway import PROMPT, decisions, pd_config, pd_worker, reference_text

pytestmark = [pytest.mark.integration]


@asynccontextmanager
async def fake_http(routes: dict[str, Any]) -> AsyncIterator[tuple[int, list[str]]]:
    """An aiohttp server on a free loopback port serving ``routes`` (path -> POST handler); yields its port and the
    paths POSTed to it, in order."""
    hits: list[str] = []

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST":  # the gateway's health checks GET /health
            hits.append(request.path)
        resp: web.StreamResponse = await handler(request)
        return resp

    app = web.Application(middlewares=[count])
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port, hits
    finally:
        await runner.cleanup()


async def _not_found(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "nothing parked here"}}, status=404)


def nothing_held(g: Gw) -> None:
    assert len(g.gw.pd.ledger) == 0 and g.gw.admission.num_inflight == 0 and g.gw.pd.num_waiting == 0
    lines = g.gw.metrics.render().decode().splitlines()
    assert 'kvgate_pd_reserved_blocks{worker="d0"} 0.0' in lines
    assert 'kvgate_pd_transfer_bytes_ahead{worker="d0"} 0.0' in lines
    assert "kvgate_pd_waiting_requests 0.0" in lines


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_the_clients_own_pd_fields_never_steer_a_pull(protocol):
    """A client that sends its own ``kv_transfer_params`` (a complete remote prefill pointing at a server of its
    choosing) and its own bootstrap fields (pointing there too, or of junk types) gets the answer the gateway's own
    handshake gives, and its server is never asked for anything: the gateway owns the PD fields of both legs."""
    want = await reference_text(PROMPT, 3, 7)
    async with fake_http({"/kv/pull": _not_found, "/kv/pull/done": _not_found}) as (trap, hits):
        steer: dict[str, Any] = {
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[0]],
                                   "remote_engine_id": "evil", "remote_request_id": "r", "remote_host": "127.0.0.1",
                                   "remote_port": trap},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": trap, "bootstrap_room": 5,
        }
        junk: dict[str, Any] = {"kv_transfer_params": "junk", "bootstrap_host": ["a"], "bootstrap_port": "x",
                                "bootstrap_room": -1}
        fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode")]
        async with running(*fleet) as ws, Gw(pd_config(ws, protocol)) as g:
            await connected(g, ws)
            async with aiohttp.ClientSession() as s:
                for extra in (steer, junk):
                    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "seed": 7, **extra}
                    async with s.post(g.url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["choices"][0]["text"] == want
            assert hits == []
            assert ws[1].worker.decode_handoff.num_pulls == 2 and ws[1].worker.decode_handoff.num_failed == 0
            nothing_held(g)
            for w in ws:
                assert w.core.scheduler.parked == {} and w.core.scheduler.receiving == {}


async def test_a_prefill_worker_refusing_the_request_is_relayed_with_its_status():
    """vLLM handshake: the prefill worker refuses the client's request with a 400 (a seed out of range): the
    client gets that 400 with the worker's own OpenAI error fields, as the aggregated path relays it, not a 502;
    the prefill worker's circuit does not count it, and nothing is held."""
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "seed": 2**70}
            async with s.post(g.url + "/v1/completions", json=body) as r:
                status, answer = r.status, await r.json()
        assert status == 400, answer
        assert answer == {"error": {"message": "seed out of range", "type": "invalid_request_error",
                                    "param": "seed", "code": None}}
        assert g.gw.fleet.workers["p0"].breaker.num_consecutive_failures == 0
        rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
        assert rec["outcome"] == "UpstreamRefusedError" and rec["prefill_served_by"] is None
        assert ws[1].worker.decode_handoff.num_pulls == 0
        nothing_held(g)


@pytest.mark.parametrize("params", [
    "x",
    {"do_remote_prefill": True, "remote_port": "x", "remote_host": 5},
    {"do_remote_prefill": True},
    {"do_remote_prefill": True, "remote_block_ids": [1, [2]], "remote_engine_id": "p", "remote_request_id": "r",
     "remote_host": "127.0.0.1", "remote_port": 1},
    {"do_remote_decode": True},
])
async def test_a_prefill_worker_answering_unusable_kv_transfer_params_is_its_failure(params):
    """vLLM handshake: a prefill worker answers 200 with ``kv_transfer_params`` no decode worker can use (not an
    object, wrong types, incomplete, mixed block lists, asking for a remote decode): the client gets a 502 that
    names the prefill worker (not the decode worker's 400 about a field it never sent), the prefill worker's
    circuit counts a failure, the decode worker is never asked, and nothing is held."""

    async def prefill(request: web.Request) -> web.Response:
        return web.json_response({
            "id": "cmpl-1", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 101, "completion_tokens": 1, "total_tokens": 102},
            "kv_transfer_params": params,
        })

    async with fake_http({"/v1/completions": prefill}) as (port, hits):
        fleet = [pd_worker("d0", "decode")]
        async with running(*fleet) as ws:
            config = pd_config(ws)
            fake = {"id": "p0", "url": f"http://127.0.0.1:{port}", "model": MODEL, "role": "prefill",
                    "events_endpoint": None, "load_path": None, "snapshot_path": None}
            config = msgspec.structs.replace(config, workers=(*config.workers, decode_worker(fake)))
            async with Gw(config) as g:
                await connected(g, ws)
                async with aiohttp.ClientSession() as s:
                    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
                    async with s.post(g.url + "/v1/completions", json=body) as r:
                        status, answer = r.status, await r.json()
                assert status == 502, answer
                assert answer["error"]["code"] == "upstream_error"
                assert answer["error"]["message"].startswith(
                    "every prefill attempt failed: prefill worker p0 answered kv_transfer_params no decode worker "
                    "can use: ")
                assert hits == ["/v1/completions"]
                assert g.gw.fleet.workers["p0"].breaker.num_consecutive_failures == 1
                d = ws[0].worker.decode_handoff
                assert d.num_pulls == 0 and d.num_failed == 0
                assert ws[0].core.scheduler.receiving == {}
                nothing_held(g)


async def test_a_request_no_decode_worker_can_ever_hold_is_a_400_at_once():
    """The only decode worker has 512 blocks of 16 tokens: a request whose prompt plus ``max_tokens`` need more
    (101 + 10**6 tokens: 62,507 blocks) can never fit, so it is refused at once with a 400 that says so, instead of
    waiting ``queue_timeout_s`` in the capacity queue and then being told (429, ``Retry-After``) to come back; it
    takes no wait slot and counts no capacity rejection. A request that fits is served."""
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(
        ws, pd={"queue_timeout_s": 30.0, "max_waiting": 1}, load_poll={"interval_s": 0.05}
    )) as g:
        await connected(g, ws)
        await wait_until(lambda: g.gw.fleet.workers["d0"].load is not None, what="d0's first load poll")
        async with aiohttp.ClientSession() as s:
            for max_tokens in (10**6, 512 * 16):
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens}
                async with s.post(g.url + "/v1/completions", json=body) as r:
                    status, answer = r.status, await r.json()
                assert status == 400 and "Retry-After" not in r.headers, answer
                blocks = -(-(101 + max_tokens) // 16)
                assert answer["error"] == {
                    "message": f"the request needs {blocks} KV blocks on a decode worker (101 prompt + {max_tokens} "
                               "output tokens, 16 per block); the largest decode worker can hold 512",
                    "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 512 * 16 - 112}  # 512 blocks exactly
            async with s.post(g.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        assert g.gw.pd.num_rejected == 0
        nothing_held(g)
