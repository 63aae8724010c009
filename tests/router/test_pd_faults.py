"""Hostile clients and workers on the disaggregated path (real sim workers, real HTTP, the gateway's real handler
cancellation): whatever leaves or fails, every reservation, wait slot and admission slot returns to 0."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.router.sim_fleet import MODEL, Gw, SimWorker, connected, running, wait_until
from tests.router.test_pd_gateway import PROMPT, hold_decode_blocks, hold_decode_slot, pd_config, pd_worker

pytestmark = [pytest.mark.integration]


async def test_clients_leaving_while_they_wait_for_decode_room_give_their_wait_slots_back():
    """max_waiting 1: a client that waits for decode room and disconnects frees its place in the wait queue, so the
    next request waits (then times out with the queue_timeout_s message) instead of being refused at once."""
    # the request needs 7 of d0's 12 blocks, 6 of which a transfer the gateway does not know holds
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode", num_gpu_blocks=12, **{"pull-timeout-s": 60.0})]
    async with running(*fleet) as ws, Gw(pd_config(
        ws, pd={"queue_timeout_s": 2.0, "max_waiting": 1}, load_poll={"interval_s": 0.05}
    )) as g:
        await connected(g, ws)
        held = await hold_decode_blocks(g, ws[0], ws[1], num_free=6)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        for _ in range(3):
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(g.url + "/v1/completions", json=body))
                await wait_until(lambda: g.gw.pd.num_waiting == 1, what="the request waiting")
                task.cancel()  # the client leaves while it waits
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_until(lambda: g.gw.admission.num_inflight == 0, what="the admission slot back")
            await wait_until(lambda: g.gw.pd.num_waiting == 0, what="the wait slot back")
        assert g.gw.pd.num_rejected == 0 and len(g.gw.pd.ledger) == 0
        lines = g.gw.metrics.render().decode().splitlines()
        assert "kvgate_pd_waiting_requests 0.0" in lines
        async with aiohttp.ClientSession() as s, s.post(g.url + "/v1/completions", json=body) as r:
            assert r.status == 429
            err = (await r.json())["error"]
        assert "within 2.0 s" in err["message"]  # it waited: the queue had room
        assert g.gw.pd.num_waiting == 0 and g.gw.pd.num_rejected == 1
        held.cancel()


async def test_a_decode_worker_refusing_every_transfer_is_a_clean_503_and_the_parked_kv_times_out():
    """The only decode worker refuses every transfer (its one sequence slot is held): the client gets the refusal
    as an OpenAI error, the gateway holds no reservation or slot, and the prefill worker's parked KV is freed by its
    abort timer (vLLM's ``abort-request-timeout-s``) since no decode worker will pull it."""
    fleet = [pd_worker("p0", "prefill", **{"abort-request-timeout-s": 1.0}),
             pd_worker("d0", "decode", **{"receive-wait-s": 0.0})]  # refuses at once
    fleet[1].raw["scheduler"]["max-num-seqs"] = 1
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        held = await hold_decode_slot(ws[0], ws[1])
        try:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
            for _ in range(2):
                async with aiohttp.ClientSession() as s, s.post(g.url + "/v1/completions", json=body) as r:
                    status, answer = r.status, await r.json()
                assert status == 503 and answer["error"]["code"] == "kv_transfer_refused", answer
            assert ws[1].worker.decode_handoff.num_refused == 2
            assert len(g.gw.pd.ledger) == 0 and g.gw.admission.num_inflight == 0 and g.gw.pd.num_waiting == 0
            assert len(ws[0].worker.core.scheduler.parked) == 2
            await wait_until(lambda: ws[0].worker.core.scheduler.parked == {}, what="the parked KV freed")
            lines = g.gw.metrics.render().decode().splitlines()
            assert 'kvgate_pd_reserved_blocks{worker="d0"} 0.0' in lines
            assert 'kvgate_pd_transfer_bytes_ahead{worker="d0"} 0.0' in lines
        finally:
            held.cancel()


async def test_a_decode_worker_dying_mid_stream_ends_the_stream_with_an_openai_error_event():
    """The decode worker is stopped after the stream's first token: the openai client's stream ends with an error
    event (``APIError``), not a silent truncation; nothing stays reserved, waiting or admitted."""
    fleet = [pd_worker("p0", "prefill"), SimWorker("d0", time_scale=1.0)]
    fleet[1].raw["role"] = "decode"
    fleet[1].raw["kv-transfer"] = {"abort-request-timeout-s": 30.0}
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        got: list[str] = []
        try:
            stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
            with pytest.raises(openai.APIError):
                async for chunk in stream:
                    if chunk.choices:
                        got.append(chunk.choices[0].text)
                    if len(got) == 1:
                        _kill_connections(ws[1])  # the decode worker dies mid-stream
        finally:
            await c.close()
        assert got
        await wait_until(lambda: len(g.gw.pd.ledger) == 0 and g.gw.admission.num_inflight == 0)
        assert g.gw.pd.num_waiting == 0 and ws[0].worker.core.scheduler.parked == {}
        lines = g.gw.metrics.render().decode().splitlines()
        assert 'kvgate_pd_reserved_blocks{worker="d0"} 0.0' in lines


def _kill_connections(worker: SimWorker) -> None:
    """Abort every connection the worker's HTTP server holds, as a killed process's would be (reset, no end)."""
    assert worker.runner is not None and worker.runner.server is not None
    for handler in list(worker.runner.server.connections):
        if handler.transport is not None:
            handler.transport.abort()
