"""The gateway in front of a disaggregated sim fleet (prefill and decode workers, real KV events, real HTTP),
driven by the official ``openai`` client: exact decisions for both legs, the prefill leg's honesty check, both wire
protocols, decode refusal and retry, capacity queueing then 429, and faults (dead prefill, dead decode) with every
reservation released."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from tests.router.sim_fleet import (
    BLOCK_SIZE,
    MODEL,
    Gw,
    SimWorker,
    connected,
    in_sync,
    make_config,
    running,
    wait_until,
)

pytestmark = [pytest.mark.integration]

PROMPT = "".join(chr(ord("a") + i % 26) for i in range(6 * BLOCK_SIZE + 5))  # 101 byte tokens: 7 blocks


def pd_worker(worker_id: str, role: str, num_gpu_blocks: int = 512, **kv_transfer: Any) -> SimWorker:
    w = SimWorker(worker_id, num_gpu_blocks=num_gpu_blocks)
    w.raw["role"] = role
    w.raw["kv-transfer"] = {"abort-request-timeout-s": 30.0, **kv_transfer}
    return w


def pd_config(workers: list[SimWorker], protocol: str = "vllm", pd: dict[str, Any] | None = None, **overrides: Any):
    roles = {w.worker_id: {"role": w.raw["role"]} for w in workers}
    models = [{"name": MODEL, "block_size": BLOCK_SIZE, "default_max_tokens": 4,
               "pd": {"protocol": protocol, **(pd or {})}}]
    return make_config(workers, worker_extra=roles, models=models, **overrides)


async def decisions(g: Gw) -> list[dict[str, Any]]:
    status, body = await g.admin("GET", "/admin/decisions")
    assert status == 200
    out: list[dict[str, Any]] = body["decisions"]
    return out


def client(g: Gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)


async def reference_text(prompt: str, max_tokens: int, seed: int) -> str:
    async with running(SimWorker("ref")) as (ref,), aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "seed": seed}
        async with s.post(ref.url + "/v1/completions", json=body) as r:
            text: str = (await r.json())["choices"][0]["text"]
            return text


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_two_plus_two_both_legs_recorded_and_the_prefill_leg_honest(protocol):
    want = await reference_text(PROMPT, 5, 11)
    fleet = [pd_worker("p0", "prefill"), pd_worker("p1", "prefill"), pd_worker("d0", "decode"),
             pd_worker("d1", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(ws, protocol)) as g:
        await connected(g, ws)
        c = client(g)
        try:
            first = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, seed=11)
            assert first.choices[0].text == want
            await in_sync(g.gw, ws)  # both legs' KV events reached the index (prefill side and decode side)
            text = ""
            async for chunk in await c.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=5, seed=11, stream=True, stream_options={"include_usage": True}
            ):
                if not chunk.choices:
                    continue
                text += chunk.choices[0].text
            assert text == want
        finally:
            await c.close()
        recs = [d for d in await decisions(g) if d.get("kind") == "pd"]
        second, one = recs[0], recs[1]  # most recent first
        # first request: nothing cached anywhere, ties break in configuration order
        assert (one["prefill_worker_id"], one["decode_worker_id"]) == ("p0", "d0")
        assert one["predicted_cached_tokens"] == {"p0": 0, "p1": 0} and one["reported_cached_tokens"] == 0
        # 101 prompt + 5 output tokens = 7 blocks reserved; 101 tokens of 128 KiB each pulled
        assert one["num_reserved_blocks"] == 7 and one["num_transfer_bytes"] == 101 * 131072
        assert one["decode_fits"] == {"d0": True, "d1": True} and one["outcome"] == "ok"
        # second request: the prefix lives on p0 (96 tokens: 6 full blocks before the last token), honestly
        assert second["prefill_worker_id"] == "p0" and second["prefill_reason"] == "min_ttft"
        assert second["predicted_cached_tokens"] == {"p0": 96, "p1": 0} and second["reported_cached_tokens"] == 96
        assert second["prefill_scores"]["p0"] < second["prefill_scores"]["p1"]
        # d0 holds the received prefix (6 full blocks): it pulls only the last 5 tokens and reserves the one block
        # its 5 + 5 new tokens need (ceil(106 / 16) = 7 minus the 6 it holds)
        assert second["decode_worker_id"] == "d0" and second["num_transfer_bytes"] == 5 * 131072
        assert second["num_reserved_blocks"] == 1
        assert second["decode_scores"]["d0"] < second["decode_scores"]["d1"]
        assert len(g.gw.pd.ledger) == 0 and g.gw.pd.ledger.reserved_blocks("d0") == 0
        assert g.gw.proxy.num_honesty_mismatches == 0
        for w in ws:
            kv = w.worker.core.scheduler  # nothing parked or receiving anywhere
            assert kv.parked == {} and kv.receiving == {}


async def test_one_plus_three_a_refusing_decode_worker_is_retried_on_another():
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode", **{"receive-wait-s": 0.0}),
             pd_worker("d1", "decode"), pd_worker("d2", "decode")]
    fleet[1].raw["scheduler"]["max-num-seqs"] = 1  # refuses at once (an engine that does not queue)
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        # d0's one sequence slot is held, so d0 refuses the gateway's transfer (503) and the gateway retries d1
        held = await hold_decode_slot(ws[0], ws[1])
        c = client(g)
        try:
            got = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
            assert got.choices[0].finish_reason == "length"
        finally:
            await c.close()
            held.cancel()
        rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
        assert rec["decode_worker_id"] == "d0" and rec["decode_served_by"] == "d1"
        assert ws[1].worker.decode_handoff.num_refused == 1
        assert len(g.gw.pd.ledger) == 0
        assert ws[0].worker.core.scheduler.parked == {}  # d1 pulled the parked KV


async def hold_decode_slot(prefill: SimWorker, decode: SimWorker, prompt: str = "zz") -> asyncio.Task[int]:
    """Hold ``decode``'s one sequence slot (``scheduler.max-num-seqs: 1``) and the blocks of ``prompt`` with a decode
    leg sent to it directly (the gateway does not know) for a room nobody prefills on ``prefill``; returns once it
    holds them, with the request's task (its HTTP status), which the test cancels when done."""
    held = asyncio.create_task(post_status(decode.url + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.port, "bootstrap_room": 999}))
    try:
        await wait_until(lambda: len(decode.worker.core.scheduler.receiving) == 1,
                         what=f"{decode.worker_id} holds its slot")
    except BaseException:
        held.cancel()
        raise
    return held


async def post_status(url: str, body: dict[str, Any]) -> int:
    """POST ``body`` as JSON; the answer's HTTP status (its body read whole)."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        await r.read()
        return r.status


async def hold_decode_blocks(g: Gw, prefill: SimWorker, decode: SimWorker, num_free: int) -> asyncio.Task[int]:
    """Hold all but ``num_free`` of ``decode``'s 12 blocks (``hold_decode_slot`` with a prompt of that many blocks
    less ``num_free``) until the gateway's load poll has seen it."""
    held = await hold_decode_slot(prefill, decode, prompt="z" * (12 - num_free) * BLOCK_SIZE)
    load = lambda: g.gw.fleet.workers[decode.worker_id].load  # noqa: E731
    await wait_until(lambda: (w := load()) is not None and w.num_free_gpu_blocks == num_free,
                     what=f"the gateway's poll of {decode.worker_id}'s {num_free} free blocks")
    return held


async def test_no_decode_room_waits_then_429_and_the_queue_is_released():
    # the request needs 7 of d0's 12 blocks, 6 of which a transfer the gateway does not know holds
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode", num_gpu_blocks=12, **{"pull-timeout-s": 60.0})]
    async with running(*fleet) as ws, Gw(pd_config(
        ws, pd={"queue_timeout_s": 0.3, "retry_after_s": 2.0}, load_poll={"interval_s": 0.05}
    )) as g:
        await connected(g, ws)
        held = await hold_decode_blocks(g, ws[0], ws[1], num_free=6)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
                async with s.post(g.url + "/v1/completions", json=body) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "2"
                    err = (await r.json())["error"]
        finally:
            held.cancel()
        assert "no decode worker could take the request's KV within 0.3 s" in err["message"]
        assert g.gw.pd.num_waiting == 0 and g.gw.pd.num_rejected == 1 and len(g.gw.pd.ledger) == 0
        assert g.gw.admission.num_inflight == 0
        text = g.gw.metrics.render().decode()
        assert 'kvgate_pd_capacity_rejected_total 1.0' in text.splitlines()
        assert 'kvgate_pd_waiting_requests 0.0' in text.splitlines()
        assert 'kvgate_pd_reservations_made_total 0.0' in text.splitlines()  # the request never held one
        assert 'kvgate_pd_reserved_blocks{worker="d0"} 0.0' in text.splitlines()
        assert 'kvgate_pd_reserved_blocks{worker="p0"}' not in text  # a prefill worker holds no decode room


async def test_a_dead_prefill_worker_is_retried_and_a_dead_decode_worker_too():
    fleet = [pd_worker("p0", "prefill"), pd_worker("p1", "prefill"), pd_worker("d0", "decode"),
             pd_worker("d1", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        await ws[0].stop()  # p0 dies (the gateway's health checks have not noticed)
        await ws[2].stop()  # d0 dies
        c = client(g)
        try:
            got = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
            assert got.choices[0].finish_reason == "length"
        finally:
            await c.close()
        rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
        assert (rec["prefill_worker_id"], rec["prefill_served_by"]) == ("p0", "p1")
        assert (rec["decode_worker_id"], rec["decode_served_by"]) == ("d0", "d1")
        assert len(g.gw.pd.ledger) == 0 and ws[1].worker.core.scheduler.parked == {}
        lines = g.gw.metrics.render().decode().splitlines()
        # reserved on d0, moved to d1 by the retry (a release and a new reservation), released at the end
        assert 'kvgate_pd_reservations_made_total 2.0' in lines
        assert 'kvgate_pd_reservations_released_total 2.0' in lines
        for wid in ("d0", "d1"):
            assert f'kvgate_pd_reserved_blocks{{worker="{wid}"}} 0.0' in lines
            assert f'kvgate_pd_reservations{{worker="{wid}"}} 0.0' in lines
            assert f'kvgate_pd_transfer_bytes_ahead{{worker="{wid}"}} 0.0' in lines


async def test_every_prefill_worker_dead_is_a_clean_openai_error_with_nothing_reserved():
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        await ws[0].stop()
        c = client(g)
        try:
            with pytest.raises(openai.APIStatusError) as err:
                await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        finally:
            await c.close()
        assert err.value.status_code == 502
        assert len(g.gw.pd.ledger) == 0 and g.gw.admission.num_inflight == 0
        assert ws[1].worker.core.scheduler.receiving == {}
        rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
        assert rec["outcome"] == "UpstreamError" and rec["prefill_served_by"] is None


async def test_a_client_leaving_mid_stream_is_recorded_as_served_by_its_decode_worker():
    """The client reads the decode leg's first chunk and leaves: the record names the decode worker that served the
    answer (its stream began) with outcome client_gone, and every reservation is released."""
    fleet = [pd_worker("p0", "prefill"), SimWorker("d0", time_scale=1.0)]
    fleet[1].raw["role"] = "decode"
    fleet[1].raw["kv-transfer"] = {"abort-request-timeout-s": 30.0}
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.content.readany()).startswith(b"data: ")
        # the connection is closed; the gateway's handler is cancelled
        await wait_until(lambda: len(g.gw.pd.ledger) == 0)
        recs = [d for d in await decisions(g) if d.get("kind") == "pd"]
        await wait_until(lambda: bool(recs))
        rec = recs[0]
        assert (rec["prefill_served_by"], rec["decode_served_by"], rec["outcome"]) == ("p0", "d0", "client_gone")
        assert g.gw.admission.num_inflight == 0


async def test_a_session_keeps_its_decode_worker_over_a_better_cached_one():
    """The decode leg is sticky too: a session's next turn goes to the decode worker that served its last turn (it
    holds the conversation's KV), even where another decode worker holds more of the new prompt."""
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode"), pd_worker("d1", "decode")]
    other = "".join(chr(ord("A") + i % 26) for i in range(4 * BLOCK_SIZE + 3))
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        c = client(g)
        try:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                       extra_headers={"x-session-id": "s1"})
            await in_sync(g.gw, ws)
            assert (await g.admin("POST", "/admin/workers/d0/drain"))[0] == 200
            await c.completions.create(model=MODEL, prompt=other, max_tokens=2)  # no session: d1 holds `other`
            assert (await g.admin("POST", "/admin/workers/d0/undrain"))[0] == 200
            await in_sync(g.gw, ws)
            await c.completions.create(model=MODEL, prompt=other, max_tokens=2)  # no session: d1, its prefix
            await c.completions.create(model=MODEL, prompt=other, max_tokens=2, extra_headers={"x-session-id": "s1"})
        finally:
            await c.close()
        recs = [d for d in await decisions(g) if d.get("kind") == "pd"]
        turn2, free, _, turn1 = recs[:4]
        assert (turn1["decode_worker_id"], turn1["session_key"]) == ("d0", "sid:s1")
        assert (free["decode_worker_id"], free["decode_reason"]) == ("d1", "min_decode_cost")
        assert free["decode_scores"]["d1"] < free["decode_scores"]["d0"]  # d1 holds the prompt, d0 does not
        assert (turn2["decode_worker_id"], turn2["decode_reason"]) == ("d0", "sticky")
        assert g.gw.pd.decode_owners == {"sid:s1": "d0"} and len(g.gw.pd.ledger) == 0


async def test_a_prefill_leg_mismatch_is_counted_with_its_cause():
    """The prefill worker drops its prefix cache while its events do not reach the gateway: the next prefill leg is
    predicted a hit it does not get, and the mismatch is counted with its cause (``index``: nothing the worker
    reported explains it), as on the aggregated path."""
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        c = client(g)
        try:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            await in_sync(g.gw, ws)
            # in_sync counts the first leg's pending entries too: wait for its stores to confirm them, or a
            # confirmation landing after the second decision reads as the "pending" cause instead
            await wait_until(lambda: g.gw.indexes[MODEL].stats().num_approx_blocks == 0,
                             what="the first leg's pending entries confirmed")
            core = ws[0].worker.core
            assert core.publisher is not None
            core.publisher.set_faults(drop_sends=True, refuse_replay=False)  # what it publishes from now on is lost
            assert core.kv.reset_prefix_cache()
            core.flush_events()
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        finally:
            await c.close()
        rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
        assert rec["predicted_cached_tokens"] == {"p0": 96} and rec["reported_cached_tokens"] == 0
        m = g.gw.metrics.worker("p0")
        assert m.num_checks_mismatch == 1 and m.num_mismatches == {"index": 1, "evicted": 0, "pending": 0, "late": 0}
