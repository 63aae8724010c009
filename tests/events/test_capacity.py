"""The KV event rank-stream ceiling: libzmq's default of 1,023 sockets (3 a stream: 341 streams) no longer bounds
the subscriber, and a gateway whose workers need more streams than its open-files limit allows refuses to start,
naming the limit (real ZMQ; a real ``kvgate serve`` process under a lowered RLIMIT_NOFILE)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from events.capacity import rank_stream_capacity
from events.subscriber import KVEventSubscriber, SubscriberConfig, WorkerSpec
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def test_capacity_names_the_tighter_limit() -> None:
    by_sockets = rank_stream_capacity(1023, 20_000)
    assert (by_sockets.num_streams, by_sockets.limit) == (335, "max_sockets")
    assert by_sockets.reason == "the ZMQ context allows 1023 sockets (3 a rank stream, 16 reserved): 335 rank streams"
    by_files = rank_stream_capacity(65_535, 1024)
    assert (by_files.num_streams, by_files.limit) == (128, "open_files")
    assert rank_stream_capacity(65_535, 100).num_streams == 0


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_subscriber_follows_more_than_341_rank_streams() -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 512 + 4 * 400:
        pytest.skip("the open-files limit is too low for 400 rank streams")
    sub = KVEventSubscriber(SubscriberConfig(), lambda item: None)
    assert sub.max_sockets == zmq.Context.instance().get(zmq.SOCKET_LIMIT)
    port = free_port()
    try:
        await sub.start()
        for worker in range(2):
            for rank in range(200):  # nobody listens there: ZMQ connects in the background
                sub.add_worker(WorkerSpec(worker_id=f"w{worker}", endpoint=f"tcp://127.0.0.1:{port}",
                                          dp_rank=rank))
        assert sum(len(ranks) for ranks in sub._specs.values()) == 400
    finally:
        await sub.aclose()


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.integration
def test_a_start_over_the_open_files_limit_is_refused_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"listen: {{host: 127.0.0.1, port: {free_port()}}}\n"
        "models: [{name: m, block_size: 16}]\n"
        "workers:\n"
        f'  - {{id: w0, url: "http://127.0.0.1:9", model: m, events_endpoint: "tcp://127.0.0.1:20000", '
        "dp_ranks: 100, load_path: null, snapshot_path: null}\n"
        f'  - {{id: w1, url: "http://127.0.0.1:9", model: m, events_endpoint: "tcp://127.0.0.1:21000", '
        "dp_ranks: 100, load_path: null, snapshot_path: null}\n"
        "admin: {disable_auth: true}\n", encoding="utf-8")
    proc = subprocess.run(
        ["timeout", "60", sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=90, preexec_fn=_limit_open_files,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line.split(" ", 2)[2] for line in proc.stderr.splitlines() if " ERROR " in line]
    assert errors == [
        "ERROR router.serve: workers: 200 KV event rank streams (the workers' dp_ranks) are more than this process "
        "can follow: the open-files limit (RLIMIT_NOFILE) is 1024 (4 descriptors a rank stream, 512 reserved): 128 "
        "rank streams; raise it with `ulimit -n` or the container's nofile limit"]
