"""The request path under abuse, against simulated workers: a client that goes away while its request is queued on
its worker leaves no pending blocks behind, and the in-flight counters and admission slots return to exactly 0.
(The other abuse cases run on the mock transport: ``test_proxy_on_mock_transport``.)
"""

from __future__ import annotations

import aiohttp
import pytest

from tests.router.harness import is_idle, wait_until
from tests.router.sim_fleet import Gw, SimWorker, connected, running
from tests.router.sim_fleet import make_config as sim_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_a_request_abandoned_while_queued_on_its_worker_leaves_no_pending_blocks_behind():
    """The client of a streamed request queued on its worker leaves after the headers, before the first chunk: the
    worker drops it without caching a block, so the pending entries its routing inserted are withdrawn; the same
    prompt next predicts exactly what the worker reports (0), not the abandoned request's blocks."""
    w0 = SimWorker("w0", time_scale=1.0, timing={"step-overhead-s": 0.05})
    w0.raw["scheduler"]["max-num-seqs"] = 1  # one request at a time: the next waits in the worker's queue
    async with running(w0) as ws, Gw(sim_config(ws)) as g:
        await connected(g, ws)
        runtime = g.gw.fleet.workers["w0"]
        assert g.session is not None
        blocker = await g.session.post(g.url + "/v1/completions", json={
            "model": "m", "prompt": "blocker " * 4, "max_tokens": 20, "stream": True})
        await blocker.content.readline()
        prompt = "the abandoned prompt " * 8  # 168 byte-level tokens: 10 full blocks of 16
        async with aiohttp.ClientSession() as s:
            abandoned = await s.post(g.url + "/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 2, "stream": True})
            assert abandoned.status == 200  # the worker's headers: they come before its prefill
            assert runtime.num_inflight_requests == 2 and runtime.num_decoding_requests == 1
            abandoned.close()  # the client leaves before the first chunk
        await wait_until(lambda: runtime.num_inflight_requests == 1)
        await blocker.read()
        blocker.release()
        assert await g.complete(prompt) == ("w0", 0, 0)
        assert g.gw.proxy.num_honesty_mismatches == 0
        assert is_idle(g.gw)
