"""The shared pool under churn against a real ``mooncake_master`` (``benchmarks.pool_churn``, bounded here): two
rounds of 2,000 requests, 16 sessions in flight sharing their first blocks, 4 workers on one 16 MiB pool that the
live working set overflows, blocks of 128 KiB checked byte for byte on every restore, a gateway index fed the
workers' events and kept by the pool watcher, and the master killed and restarted in the middle of round 2.

The run happens in a fresh interpreter: Mooncake clients that earlier tests of the same process left behind
(each keeps pinging its master on threads of its own) and their timers must not share the run's two cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store")

from benchmarks.pool_churn import ChurnConfig, run_churn  # noqa: E402
from tests.mooncake_master import running_master  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
CHILD = ("import asyncio; from tests.workers.test_pool_churn_mooncake import check_two_rounds_of_churn; "
         "asyncio.run(check_two_rounds_of_churn())")


def test_two_rounds_of_churn_on_a_real_master_that_evicts_and_restarts() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, (
        f"churn run failed (exit {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-12000:]}")


async def check_two_rounds_of_churn() -> None:
    """The whole run and its checks (in the child interpreter)."""
    config = ChurnConfig(requests_per_round=2000, restart_at=1000, down_requests=64, sweep_every=16)
    with running_master(config.lease_ttl_ms, ("--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.1")) as master:
        reports, fleet = await run_churn(config, master)  # any worker failure raises: zero crashes
        for r in reports:  # what a failed check is read against (the child runs without pytest's assert rewriting)
            print(r, flush=True)
        print(f"not in master: {fleet.pool_holdings_not_in_master()}, restarts {fleet.watcher.num_master_restarts}",
              flush=True)
        try:
            for r in reports:
                assert r.num_requests >= 2000  # every request admitted and served (none failed)
                assert r.num_evicted_keys > 200  # the master evicted all along
                assert r.num_pool_blocks_restored > 100  # restores from the pool all along
                assert r.num_fetch_mismatches == 0  # every restored block's bytes were what was stored
                # The watcher keeps pool-priced decisions from finding their blocks gone: a stale share well
                # under a watcher-less index's (most pool hits go stale within a few sweeps' worth of churn). How
                # low it gets depends on the host's speed against the sweep schedule; `python -m
                # benchmarks pool_churn` reports the figure (0.5-1.4% on a quiet run, target 5%).
                assert r.num_pool_priced > 50 and r.stale_ratio <= 0.25
            assert reports[1].num_restored_after_restart > 0  # the tier came back after the restart
            assert all(store.num_outages >= 1 and store.num_skipped_calls > 0 for store in fleet.stores)
            watcher = fleet.watcher
            assert watcher.num_master_restarts + watcher.num_ttl_clears >= 1 and watcher.num_failed_sweeps >= 1
            if fleet.pool_holdings_not_in_master():
                # The master also evicts on a thread of its own: what it dropped after the final sweep (or while
                # that sweep was refused) is the next sweep's to drop, as a running watcher's next interval does.
                await fleet.watcher.open()
                try:
                    assert await fleet.watcher.sweep()
                finally:
                    await fleet.watcher.close()
            assert fleet.pool_holdings_not_in_master() == 0  # the index dropped what the old master held
            assert sum(kv.pool.num_blocks_fetched for kv in fleet.workers if kv.pool is not None) == sum(
                r.num_pool_blocks_restored for r in reports)
        finally:
            fleet.close()
