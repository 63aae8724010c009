"""Two vLLM (CPU) workers on one ``mooncake_master``, each with vLLM's ``MooncakeStoreConnector`` (embedded), behind
the gateway with ``pools: [MOONCAKE]``, ``pool_event_media: [CPU]`` and the pool watcher.

Worker B serves a prefix worker A stored in the pool: the gateway, which heard A's ``medium: "cpu"`` pool writes
as the shared pool tier, predicts B's external hit exactly. Once the master no longer holds the blocks (every
object removed through a client), the watcher's next sweep drops them, and the gateway stops predicting them
(predicted = reported = 0), where without it the stale entries would be priced (``test_vllm_mooncake.py``
pins that gap for a worker without ``pool_event_media``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.interop.client import send, token_ids
from tests.interop.conftest import (
    BLOCK_SIZE,
    Gateway,
    VllmWorker,
    free_port,
    gateway_config,
    sum_metric,
    wait_http_ok,
    worker_entry,
)
from tests.interop.test_vllm_mooncake import clear_pool, local_master, pool_keys, require_mooncake

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(2400)]

START_TIMEOUT_S = 900.0
"""Per vLLM start: the suite's 300 s is not always enough for an engine with the Mooncake connector on a busy
2-core host."""


@dataclass
class SharedPoolFleet:
    gateway: Gateway
    workers: dict[str, VllmWorker]
    master_admin_url: str
    store_config: dict[str, str]


@pytest.fixture(scope="module")
def shared_pool(interop_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedPoolFleet]:
    require_mooncake()
    log_dir: Path = tmp_path_factory.mktemp("mooncake-pool")
    mc = local_master(log_dir, global_segment_size="128MB", local_buffer_size="64MB")
    master = mc.process
    connector = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})
    workers: dict[str, VllmWorker] = {}
    entries = []
    for wid in ("vllm-a", "vllm-b"):
        port = free_port()
        workers[wid] = VllmWorker(wid, free_port(), f"tcp://*:{port}", "kv-events", log_dir,
                                  extra_args=["--kv-transfer-config", connector],
                                  extra_env={"MOONCAKE_CONFIG_PATH": str(mc.config_path)})  # fmt: skip
        entry = worker_entry(wid, workers[wid].url, events_endpoint=f"tcp://127.0.0.1:{port}", topology="connect",
                             pools=("MOONCAKE",))  # fmt: skip
        entry["pool_event_media"] = ["CPU"]
        entries.append(entry)
    config = gateway_config(free_port(), f"tcp://127.0.0.1:{free_port()}", entries,
                            {"name": "cache_aware", "enable_calibration": False})  # fmt: skip
    config["pool_watch"] = {"admin_url": mc.admin_url, "lease_ttl_s": 5.0, "entry_ttl_s": 5.0,
                            "interval_s": 0.5}  # fmt: skip
    gateway = Gateway(config, log_dir)
    try:
        master.start()
        wait_http_ok(master, mc.admin_url + "/metrics", 30.0)
        gateway.start()
        for w in workers.values():  # one at a time: two starting at once on 2 cores take longer than both in turn
            w.start()
            assert w.process is not None
            wait_http_ok(w.process, w.url + "/health", START_TIMEOUT_S)
        for wid in workers:
            gateway.wait_events_flowing(wid)
        yield SharedPoolFleet(gateway, workers, mc.admin_url, mc.store_config)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        for w in workers.values():
            w.stop()
        gateway.stop()
        master.stop()


def num_sweeps(gw: Gateway) -> int:
    return int(sum_metric(gw.metrics_text(), "kvgate_pool_watch_total", 'counter="num_sweeps"'))


def wait_sweeps(gw: Gateway, num: int = 2, timeout_s: float = 30.0) -> None:
    target = num_sweeps(gw) + num
    deadline = time.monotonic() + timeout_s
    while num_sweeps(gw) < target:
        assert time.monotonic() < deadline, "the pool watcher did not sweep"
        time.sleep(0.2)


def test_b_loads_what_a_stored_predicted_as_reported(shared_pool: SharedPoolFleet) -> None:
    gw = shared_pool.gateway
    prompt = token_ids(70, 260)  # 8 full blocks of 32
    first = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, {"x-kvgate-worker": "vllm-a"})
    assert (first.worker_id, first.predicted, first.reported) == ("vllm-a", 0, 0)
    assert gw.index_blocks("vllm-a", "MOONCAKE") >= 8  # A's `cpu` pool writes, applied as the shared pool
    external_before = shared_pool.workers["vllm-b"].metric("vllm:external_prefix_cache_hits_total")
    second = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, {"x-kvgate-worker": "vllm-b"})
    external = shared_pool.workers["vllm-b"].metric("vllm:external_prefix_cache_hits_total") - external_before
    assert second.reported == external == 8 * BLOCK_SIZE  # B loaded A's blocks from the pool
    assert second.predicted == second.reported  # and the gateway priced exactly that for B


def test_once_the_master_lost_them_the_gateway_stops_predicting_them(shared_pool: SharedPoolFleet) -> None:
    gw = shared_pool.gateway
    prompt = token_ids(80, 260)
    send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, {"x-kvgate-worker": "vllm-a"})
    wait_sweeps(gw)
    assert gw.index_blocks("vllm-a", "MOONCAKE") >= 8
    assert clear_pool(shared_pool.store_config) > 0
    assert pool_keys(shared_pool.master_admin_url) == []
    wait_sweeps(gw)
    assert gw.index_blocks("vllm-a", "MOONCAKE") == 0 and gw.index_blocks("vllm-b", "MOONCAKE") == 0
    external_before = shared_pool.workers["vllm-b"].metric("vllm:external_prefix_cache_hits_total")
    lost = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, {"x-kvgate-worker": "vllm-b"})
    assert shared_pool.workers["vllm-b"].metric("vllm:external_prefix_cache_hits_total") == external_before
    assert (lost.predicted, lost.reported) == (0, 0)  # not predicted once the master lost it
    text = httpx.get(gw.url + "/metrics", timeout=10.0).text
    assert sum_metric(text, "kvgate_pool_watch_total", 'counter="num_entries_dropped"') >= 8
