"""The gateway shows what its process holds: ``process_*`` series and asyncio tasks on ``/metrics``, and the top
allocation sites of a tracemalloc snapshot on ``GET /admin/debug/memory`` (token-guarded like every admin route)."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from benchmarks._probe import parse_metrics, total
from tests.router.harness import GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_metrics_show_rss_descriptors_and_tasks(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        assert h.session is not None
        async with h.session.get(h.url + "/metrics") as resp:
            metrics = parse_metrics(await resp.text())
        num_fds = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/statm") as statm:
            rss_bytes = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(total(metrics, "process_resident_memory_bytes") - rss_bytes) < 0.2 * rss_bytes
    assert abs(total(metrics, "process_open_fds") - num_fds) <= 2  # the listing's own descriptor, the answer's
    # This test's own task and the gateway's background tasks (health, load polls, event subscribers) at least.
    assert total(metrics, "kvgate_process_asyncio_tasks") >= 3


async def test_debug_memory_lists_sites_only_while_tracing(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        status, answer = await h.admin("GET", "/admin/debug/memory")
        assert status == 200
        assert answer["is_tracing"] is False and answer["sites"] == [] and answer["traced_bytes"] == 0
        status, _ = await h.admin("GET", "/admin/debug/memory", token="wrong")
        assert status == 401
        tracemalloc.start()
        try:
            kept = [bytearray(1 << 20) for _ in range(8)]  # 8 MiB from one line: the top site
            status, answer = await h.admin("GET", "/admin/debug/memory?limit=3")
        finally:
            tracemalloc.stop()
        assert status == 200 and answer["is_tracing"] is True
        assert len(answer["sites"]) == 3
        top = answer["sites"][0]
        assert top["file"] == __file__ and top["size_bytes"] >= 8 << 20 and top["num_blocks"] >= 8
        assert answer["traced_bytes"] >= 8 << 20
        del kept
