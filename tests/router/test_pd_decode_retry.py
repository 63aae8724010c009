"""The decode leg's retries and what ``/admin/decisions`` says of them (real sim workers, real HTTP): a decode worker
that dies after it pulled the prefill side's KV leaves nothing to pull for the next one, so the retry gets a fresh
prefill leg; a worker's error answer relayed to the client is never recorded as ``ok``."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.router.sim_fleet import MODEL, Gw, SimWorker, connected, running, wait_until
from tests.router.test_pd_faults import _kill_connections
from tests.router.test_pd_gateway import PROMPT, decisions, hold_decode_slot, pd_config, pd_worker, reference_text
from tests.router.test_pd_hostile import nothing_held

pytestmark = [pytest.mark.integration]


async def test_a_relayed_decode_refusal_is_recorded_with_its_status_not_as_ok():
    """The only decode worker refuses the transfer (503 ``kv_transfer_refused``, relayed to the client as the last
    attempt's answer): the decision record's outcome names that status; the request was not served."""
    fleet = [pd_worker("p0", "prefill", **{"abort-request-timeout-s": 1.0}),
             pd_worker("d0", "decode", **{"receive-wait-s": 0.0})]  # refuses at once
    fleet[1].raw["scheduler"]["max-num-seqs"] = 1
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        held = await hold_decode_slot(ws[0], ws[1])
        try:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
            async with aiohttp.ClientSession() as s, s.post(g.url + "/v1/completions", json=body) as r:
                status, answer = r.status, await r.json()
            assert status == 503 and answer["error"]["code"] == "kv_transfer_refused", answer
            rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
            assert rec["outcome"] == "status_503"
            assert rec["prefill_served_by"] == "p0" and rec["decode_served_by"] == "d0"
            assert g.gw.pd.decode_owners == {}
            nothing_held(g)
        finally:
            held.cancel()


async def test_a_decode_worker_dying_after_its_pull_is_retried_with_a_fresh_prefill_leg():
    """A non-streamed request's decode worker pulls the KV (the prefill side frees it), then its connections die
    before it answers: the next decode worker could pull nothing under the old ``kv_transfer_params``, so the gateway
    runs the prefill leg again and the client gets the reference answer from the other decode worker; the record
    names it and ``ok``, the prefill leg's honesty check is counted once, and nothing stays reserved or parked."""
    want = await reference_text(PROMPT, 200, 11)
    fleet = [pd_worker("p0", "prefill"), SimWorker("d0", time_scale=1.0), SimWorker("d1", time_scale=1.0)]
    for w in fleet[1:]:
        w.raw["role"] = "decode"
        w.raw["kv-transfer"] = {"abort-request-timeout-s": 30.0}
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        decodes = {w.worker_id: w for w in ws[1:]}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "seed": 11, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(g.url + "/v1/completions", json=body))
            await wait_until(lambda: any(w.worker.decode_handoff.num_pulls == 1 for w in decodes.values()),
                             what="a decode worker pulled the KV")
            first = next(w for w in decodes.values() if w.worker.decode_handoff.num_pulls == 1)
            assert ws[0].worker.core.scheduler.parked == {}  # pulled: the prefill side let it go
            _kill_connections(first)  # it dies before its answer's first byte
            r = await task
            status, answer = r.status, await r.json()
            r.release()
        other = next(w for w in decodes.values() if w is not first)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == want
        assert r.headers["x-kvgate-worker"] == other.worker_id
        assert other.worker.decode_handoff.num_pulls == 1 and other.worker.decode_handoff.num_failed == 0
        rec = [d for d in await decisions(g) if d.get("kind") == "pd"][0]
        assert rec["outcome"] == "ok"
        assert rec["decode_worker_id"] == first.worker_id and rec["decode_served_by"] == other.worker_id
        assert rec["prefill_served_by"] == "p0" and rec["reported_cached_tokens"] == 0
        p0 = g.gw.metrics.worker("p0")
        assert sum(p0.num_mismatches.values()) == 0
        await wait_until(lambda: ws[0].worker.core.scheduler.parked == {}, what="the second parked KV pulled")
        nothing_held(g)
