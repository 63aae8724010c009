"""A retried request gives its journal stamp back when it is settled: the proxy's last error holds the retry
loop's frame (and the plan in it) in a traceback's reference cycle, so waiting for the ticket to be collected would
hold the index's journals open until the cyclic collector runs."""

from __future__ import annotations

import gc
import logging

import pytest

from tests.router.sim_fleet import MODEL, Gw, SimWorker, connected, make_config, running
from tests.router.test_pd_gateway import PROMPT, client

pytestmark = [pytest.mark.integration]


async def test_a_retried_request_closes_its_journal_window_when_it_is_settled(caplog):
    async with running(SimWorker("w0"), SimWorker("w1")) as ws, Gw(make_config(ws)) as g:
        await connected(g, ws)
        windows = g.gw.indexes[MODEL].state.windows
        c = client(g)
        await ws[0].stop()
        gc.disable()
        try:
            with caplog.at_level(logging.WARNING, logger="router.proxy"):
                for i in range(4):
                    await c.completions.create(model=MODEL, prompt=PROMPT + str(i), max_tokens=3, seed=1)
                    assert windows.open == {}
            assert any("w0 failed before the first byte" in r.getMessage() for r in caplog.records)  # one was retried
        finally:
            gc.enable()
            await c.close()
