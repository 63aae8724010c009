"""The decode leg's retries and what ``/admin/decisions`` says of them (real sim workers, real HTTP): a worker's
error answer relayed to the client is never recorded as ``ok``."""

from __future__ import annotations

import aiohttp
import pytest

from tests.router.sim_fleet import MODEL, Gw, connected, running
from tests.router.test_pd_gateway import PROMPT, decisions, hold_decode_slot, pd_config, pd_worker
from tests.router.test_pd_hostile import nothing_held

pytestmark = [pytest.mark.integration]


async def test_a_relayed_decode_refusal_is_recorded_with_its_status_not_as_ok():
    """The only decode worker refuses the transfer (503 ``kv_transfer_refused``, relayed to the client as the last
    attempt's answer): the decision record's outcome names that status; the request was not served."""
    fleet = [pd_worker("p0", "prefill", **{"abort-request-timeout-s": 1.0}), pd_worker("d0", "decode")]
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
