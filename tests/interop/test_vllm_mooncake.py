"""vLLM's ``MooncakeStoreConnector`` against a local ``mooncake_master``: what the gateway sees of the pool.

vLLM 0.32 writes every computed block into the Mooncake pool (embedded mode: the pool segment lives in the vLLM
process) and reads it back after the block left its device cache. Its pool writes DO reach the KV event stream,
but as the worker's own lower tier: one ``BlockStored`` per block with ``medium: "cpu"`` (lower case), chained by
``parent_block_hash``, with the block's tokens, and never a ``BlockRemoved``. The pool keys carry the full SHA-256
block hash (``<model>@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@<64 hex>``); the events carry its low 64 bits.

So the gateway prices a reload from the pool exactly (it holds the blocks on the worker's CPU tier), but it cannot
know when the pool drops them (eviction, lease, a restarted master): its CPU entries then outlive the pool's
copies and it predicts a hit vLLM cannot serve. ``test_pool_loss_is_invisible_to_the_gateway`` pins that gap with
exact values; the README says what would close it.

Our reference worker's own pool tier (``workers/kv/pool_tier.py``) is checked against a real master in
``tests/workers/test_pool_mooncake.py`` and behind the gateway in ``tests/router/test_pool_watch_gateway.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from tests.interop.client import send, token_ids, wait_events_settled
from tests.interop.conftest import (
    BLOCK_SIZE,
    MOONCAKE_MASTER,
    MOONCAKE_STAMP,
    VLLM_PYTHON,
    Gateway,
    Process,
    VllmWorker,
    free_port,
    gateway_config,
    wait_http_ok,
    worker_entry,
)

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


class EventTap:
    """A raw ZMQ SUB on vLLM's bound PUB (PUB fans out, so the gateway still gets everything): every block hash
    vLLM announced in a ``BlockStored``."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.connect(endpoint)
        self.stored_hashes: dict[str, set[int]] = {}
        """Block hashes announced by ``BlockStored``, by ``medium`` as published."""
        self.removed_media: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            _, events, *_ = msgspec.msgpack.decode(payload)
            for event in events:
                if isinstance(event, dict) and event.get("type") == "BlockStored":
                    hashes = self.stored_hashes.setdefault(str(event.get("medium")), set())
                    hashes.update(int(h) for h in event["block_hashes"])
                elif isinstance(event, dict) and event.get("type") == "BlockRemoved":
                    self.removed_media.add(str(event.get("medium")))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()


@dataclass
class LocalMaster:
    """A ``mooncake_master`` on loopback (not started: HTTP metadata server on, leases of 5 s) and the
    ``MooncakeStoreConnector`` config of an embedded client of it (``MOONCAKE_CONFIG_PATH``, written to
    ``config_path``)."""

    process: Process
    admin_url: str
    store_config: dict[str, str]
    config_path: Path


def require_mooncake() -> None:
    """Skip the test when Mooncake Store is not installed in the vLLM virtualenv."""
    if not MOONCAKE_STAMP.is_file() or not MOONCAKE_MASTER.is_file():
        pytest.skip("Mooncake Store is not installed in the vLLM virtualenv (./scripts/setup-vllm --with-mooncake; "
                    "needs libibverbs1)")


def local_master(log_dir: Path, *, global_segment_size: str, local_buffer_size: str) -> LocalMaster:
    """The master on free ports, its log in ``log_dir``, and an embedded client's config with the segment each
    client contributes to the pool and its local transfer buffer (``"256MB"``...)."""
    rpc_port, http_port, admin_port = free_port(), free_port(), free_port()
    master = Process("mooncake_master", [
        str(MOONCAKE_MASTER), "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}", "--metrics_host=127.0.0.1", f"--metrics_port={admin_port}",
        "--default_kv_lease_ttl=5000",
    ], log_dir / "mooncake_master.log")  # fmt: skip
    store_config = {
        "metadata_server": f"http://127.0.0.1:{http_port}/metadata", "master_server_address": f"127.0.0.1:{rpc_port}",
        "protocol": "tcp", "device_name": "", "mode": "embedded", "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
    }  # fmt: skip
    config_path = log_dir / "mooncake_vllm.json"
    config_path.write_text(json.dumps(store_config), encoding="utf-8")
    return LocalMaster(master, f"http://127.0.0.1:{admin_port}", store_config, config_path)


@dataclass
class MooncakeFleet:
    gateway: Gateway
    worker: VllmWorker
    master_admin_url: str
    tap: EventTap
    store_config: dict[str, str]


@pytest.fixture(scope="module")
def mooncake_fleet(interop_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeFleet]:
    """mooncake_master on loopback, one vLLM with ``MooncakeStoreConnector`` (embedded pool), one gateway."""
    require_mooncake()
    log_dir: Path = tmp_path_factory.mktemp("mooncake")
    mc = local_master(log_dir, global_segment_size="256MB", local_buffer_size="128MB")
    master = mc.process
    events_port = free_port()
    worker = VllmWorker(
        "vllm-mc", free_port(), f"tcp://*:{events_port}", "kv-events", log_dir,
        extra_args=["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeStoreConnector",
                                                         "kv_role": "kv_both"})],
        extra_env={"MOONCAKE_CONFIG_PATH": str(mc.config_path)},
    )
    workers = [worker_entry("vllm-mc", worker.url, events_endpoint=f"tcp://127.0.0.1:{events_port}",
                            topology="connect", pools=("MOONCAKE",))]
    gateway = Gateway(gateway_config(free_port(), f"tcp://127.0.0.1:{free_port()}", workers,
                                     {"name": "cache_aware", "enable_calibration": False}), log_dir)
    tap: EventTap | None = None
    try:
        master.start()
        wait_http_ok(master, mc.admin_url + "/metrics", 30.0)
        gateway.start()
        tap = EventTap(f"tcp://127.0.0.1:{events_port}")  # before vLLM binds: ZMQ retries every 100 ms
        worker.start()
        worker.wait_ready()
        gateway.wait_events_flowing("vllm-mc")
        yield MooncakeFleet(gateway, worker, mc.admin_url, tap, mc.store_config)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        if tap is not None:
            tap.close()
        worker.stop()
        gateway.stop()
        master.stop()


def pool_keys(admin_url: str) -> list[str]:
    """Every key the Mooncake master holds (``/get_all_keys``)."""
    text = httpx.get(admin_url + "/get_all_keys", timeout=10.0).text
    return re.findall(r"[^\s\"',\[\]]+@[0-9a-f]{64}", text)


CLEAR_POOL = """
import json, sys
from mooncake.store import MooncakeDistributedStore
cfg = json.loads(sys.argv[1])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", cfg["metadata_server"], 0, 16 * 1024 * 1024, "tcp", "", cfg["master_server_address"])
if rc != 0:
    sys.exit(f"setup failed: {rc}")
print(store.remove_all(True))
store.close()
"""


def clear_pool(store_config: dict[str, str]) -> int:
    """Remove every object from the Mooncake pool through a pure client (no segment of its own); returns how many."""
    out = subprocess.run([str(VLLM_PYTHON), "-c", CLEAR_POOL, json.dumps(store_config)], capture_output=True,
                         text=True, timeout=60, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def evict_device_cache(gw: Gateway, first_seed: int) -> None:
    """5 x 9 blocks of fresh prompts through a 24-block device cache: whatever was there before is evicted."""
    for seed in range(first_seed, first_seed + 5):
        send(gw, "/v1/completions", {"prompt": token_ids(seed, 300), "max_tokens": 1})
    wait_events_settled(gw)


def test_pool_writes_arrive_as_cpu_events_and_price_the_reload(mooncake_fleet: MooncakeFleet) -> None:
    """Write-through to the pool shows up as ``medium: "cpu"`` events; after the device cache evicted the prompt,
    the gateway predicts the pool reload exactly as vLLM reports it (an external hit)."""
    gw, worker, tap = mooncake_fleet.gateway, mooncake_fleet.worker, mooncake_fleet.tap
    prompt = token_ids(50, 260)
    num_cpu_blocks = gw.index_blocks("vllm-mc", "CPU")
    first = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert (first.worker_id, first.predicted, first.reported) == ("vllm-mc", 0, 0)
    assert set(tap.stored_hashes) == {"GPU", "cpu"}
    assert tap.stored_hashes["cpu"] == tap.stored_hashes["GPU"]  # every device block is written through
    assert gw.index_blocks("vllm-mc", "CPU") == num_cpu_blocks + 8
    again = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert again.predicted == again.reported == 8 * BLOCK_SIZE  # device cache hit
    evict_device_cache(gw, 51)
    external_before = worker.metric("vllm:external_prefix_cache_hits_total")
    back = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    external = worker.metric("vllm:external_prefix_cache_hits_total") - external_before
    assert back.reported == external == 8 * BLOCK_SIZE  # loaded from the pool
    assert back.predicted == back.reported  # priced from the CPU-tier entries the pool writes produced
    assert gw.index_blocks("vllm-mc", "MOONCAKE") == 0  # nothing says MOONCAKE, so `pools:` plays no part
    assert tap.removed_media == {"GPU"}  # the pool never announces a removal


def test_pool_loss_is_invisible_to_the_gateway(mooncake_fleet: MooncakeFleet) -> None:
    """The pool loses its copies (here: every object removed through a client); no event says so. The gateway
    keeps the worker's CPU entries and predicts a hit that vLLM, finding nothing in the pool, does not get."""
    gw, worker = mooncake_fleet.gateway, mooncake_fleet.worker
    prompt = token_ids(50, 260)  # the previous test's prompt: on the device again after its reload
    assert clear_pool(mooncake_fleet.store_config) > 0
    assert pool_keys(mooncake_fleet.master_admin_url) == []
    evict_device_cache(gw, 61)
    external_before = worker.metric("vllm:external_prefix_cache_hits_total")
    lost = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert worker.metric("vllm:external_prefix_cache_hits_total") == external_before
    assert lost.reported == 0
    assert lost.predicted == 8 * BLOCK_SIZE  # the stale CPU entries: the overclaim this gap causes


def test_pool_keys_carry_the_full_hash_of_announced_blocks(mooncake_fleet: MooncakeFleet) -> None:
    """Each pool key ends with the 64-hex SHA-256 block hash whose low 64 bits are the hash vLLM announced for
    the same block: a watcher of the master's keys could confirm or withdraw the gateway's pool entries."""
    deadline = time.monotonic() + 10
    keys = pool_keys(mooncake_fleet.master_admin_url)
    while not keys and time.monotonic() < deadline:
        time.sleep(0.5)
        keys = pool_keys(mooncake_fleet.master_admin_url)
    assert keys, "the Mooncake master holds no keys"
    full_hashes = [k.rsplit("@", 1)[1] for k in keys]
    assert all(len(h) == 64 for h in full_hashes)
    low64 = {int(h, 16) & ((1 << 64) - 1) for h in full_hashes}
    assert low64 <= mooncake_fleet.tap.stored_hashes["cpu"]
    # Written since the pool was cleared: the 5 x 9 blocks of the last eviction round and the reloaded prompt's 8.
    assert len(low64) == len(keys) >= 5 * 9
