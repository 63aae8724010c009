"""A disaggregated request's index ticket gives its journal stamp back when the request ends, without waiting for
the cyclic collector (the flight and its decode hooks refer to each other)."""

from __future__ import annotations

import gc

import pytest

from tests.router.sim_fleet import MODEL, Gw, connected, running
from tests.router.test_pd_gateway import PROMPT, client, pd_config, pd_worker

pytestmark = [pytest.mark.integration]


async def test_a_pd_request_closes_its_journal_window_when_it_ends():
    fleet = [pd_worker("p0", "prefill"), pd_worker("d0", "decode")]
    async with running(*fleet) as ws, Gw(pd_config(ws)) as g:
        await connected(g, ws)
        windows = g.gw.indexes[MODEL].state.windows
        c = client(g)
        gc.disable()
        try:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, seed=1)
            assert windows.open == {}
        finally:
            gc.enable()
            await c.close()
