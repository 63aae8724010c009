"""vLLM's ``MooncakeStoreConnector`` against a local ``mooncake_master``: what the gateway can and cannot see.

vLLM writes every computed block into the Mooncake pool (embedded mode: the pool segment lives in the vLLM
process) and reads it back after the block left its device cache. It publishes no KV event for those pool writes
(its events only say ``medium: GPU``), and it keys the pool by the full SHA-256 block hash
(``<model>@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@<64 hex>``) while its events carry only the low 64 bits of that
hash. So the gateway's index never learns about pool copies: after an eviction it must predict no hit (it cannot
know one), even though vLLM then reports one. This module checks exactly that, and checks the fact that would let a
gateway price such hits: the low 64 bits of every pool key equal the block hash of a ``BlockStored`` event vLLM
published, so a pool-side publisher (or vLLM emitting ``BlockStored(medium="MOONCAKE")`` for its pool writes)
could be resolved through the engine hashes the index already keeps per worker.

Our reference worker has no Mooncake tier (only a CPU tier, ``workers/kv/cpu_tier.py``), so there is nothing of
ours to run beside vLLM here; a worker configured with ``pools: [MOONCAKE]`` is priced only from events that say
``medium: MOONCAKE``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from tests.interop.conftest import (
    BLOCK_SIZE,
    MOONCAKE_MASTER,
    MOONCAKE_STAMP,
    Gateway,
    Process,
    VllmWorker,
    free_port,
    gateway_config,
    wait_http_ok,
    worker_entry,
)
from tests.interop.test_vllm_fleet import send, token_ids, wait_events_settled

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
        self.stored_hashes: set[int] = set()
        self.media: set[str] = set()
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
                    self.stored_hashes.update(int(h) for h in event["block_hashes"])
                    self.media.add(str(event.get("medium")))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()


@dataclass
class MooncakeFleet:
    gateway: Gateway
    worker: VllmWorker
    master_admin_url: str
    tap: EventTap


@pytest.fixture(scope="module")
def mooncake_fleet(interop_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeFleet]:
    """mooncake_master on loopback, one vLLM with ``MooncakeStoreConnector`` (embedded pool), one gateway."""
    if not MOONCAKE_STAMP.is_file() or not MOONCAKE_MASTER.is_file():
        pytest.skip("Mooncake Store is not installed in the vLLM virtualenv (./scripts/setup-vllm --with-mooncake; "
                    "needs libibverbs1)")
    log_dir: Path = tmp_path_factory.mktemp("mooncake")
    rpc_port, http_port, admin_port = free_port(), free_port(), free_port()
    master = Process("mooncake_master", [
        str(MOONCAKE_MASTER), "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}", "--metrics_host=127.0.0.1", f"--metrics_port={admin_port}",
        "--default_kv_lease_ttl=5000",
    ], log_dir / "mooncake_master.log")
    config_path = log_dir / "mooncake_vllm.json"
    config_path.write_text(json.dumps({
        "metadata_server": f"http://127.0.0.1:{http_port}/metadata", "master_server_address": f"127.0.0.1:{rpc_port}",
        "protocol": "tcp", "device_name": "", "mode": "embedded", "global_segment_size": "256MB",
        "local_buffer_size": "128MB",
    }), encoding="utf-8")
    events_port = free_port()
    worker = VllmWorker(
        "vllm-mc", free_port(), f"tcp://*:{events_port}", "kv-events", log_dir,
        extra_args=["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeStoreConnector",
                                                         "kv_role": "kv_both"})],
        extra_env={"MOONCAKE_CONFIG_PATH": str(config_path)},
    )
    workers = [worker_entry("vllm-mc", worker.url, events_endpoint=f"tcp://127.0.0.1:{events_port}",
                            topology="connect", pools=("MOONCAKE",))]
    gateway = Gateway(gateway_config(free_port(), f"tcp://127.0.0.1:{free_port()}", workers,
                                     {"name": "cache_aware", "enable_calibration": False}), log_dir)
    tap: EventTap | None = None
    try:
        master.start()
        wait_http_ok(master, f"http://127.0.0.1:{admin_port}/metrics", 30.0)
        gateway.start()
        worker.start()
        worker.wait_ready()
        tap = EventTap(f"tcp://127.0.0.1:{events_port}")
        gateway.wait_events_flowing("vllm-mc")
        yield MooncakeFleet(gateway, worker, f"http://127.0.0.1:{admin_port}", tap)
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


def test_gateway_does_not_claim_pool_hits_it_cannot_see(mooncake_fleet: MooncakeFleet) -> None:
    gw, worker = mooncake_fleet.gateway, mooncake_fleet.worker
    prompt = token_ids(50, 260)
    first = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert (first.worker_id, first.predicted, first.reported) == ("vllm-mc", 0, 0)
    again = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert again.predicted == again.reported == 8 * BLOCK_SIZE  # device cache hit: the gateway sees it
    # 5 x 9 blocks of other prompts through a 24-block device cache: every block of `prompt` is evicted.
    for seed in range(51, 56):
        send(gw, "/v1/completions", {"prompt": token_ids(seed, 300), "max_tokens": 1})
    wait_events_settled(gw)
    external_before = worker.metric("vllm:external_prefix_cache_hits_total")
    back = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    external = worker.metric("vllm:external_prefix_cache_hits_total") - external_before
    # vLLM loaded the prefix from the pool and reports it as cached; the gateway, which saw BlockRemoved for every
    # block and no event for the pool copy, predicts nothing.
    assert back.predicted == 0
    assert back.reported == external == 8 * BLOCK_SIZE
    assert gw.index_blocks("vllm-mc", "MOONCAKE") == 0
    assert mooncake_fleet.tap.media == {"GPU"}


def test_pool_keys_carry_the_full_hash_of_announced_blocks(mooncake_fleet: MooncakeFleet) -> None:
    """What would let the gateway price pool hits: each pool key ends with the 64-hex SHA-256 block hash whose
    low 64 bits are the hash vLLM announced in ``BlockStored`` for the same block."""
    deadline = time.monotonic() + 10
    keys = pool_keys(mooncake_fleet.master_admin_url)
    while not keys and time.monotonic() < deadline:
        time.sleep(0.5)
        keys = pool_keys(mooncake_fleet.master_admin_url)
    assert keys, "the Mooncake master holds no keys"
    full_hashes = [k.rsplit("@", 1)[1] for k in keys]
    assert all(len(h) == 64 for h in full_hashes)
    low64 = {int(h, 16) & ((1 << 64) - 1) for h in full_hashes}
    assert low64 <= mooncake_fleet.tap.stored_hashes
    # 1 probe block + 2 x 8 + 5 x 9 prompt blocks were written through, each once (same block -> same key).
    assert len(low64) == len(keys) >= 8 + 5 * 9
