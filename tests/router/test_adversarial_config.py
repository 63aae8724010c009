"""Worker entries the gateway cannot use are refused naming the worker and the key: a path that does not start
with ``/`` (in the YAML and on ``POST /admin/workers``), and, at ``kvgate serve`` start-up, a worker whose event
subscription cannot start (one error line and exit status 2, never a traceback)."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router.config import decode_worker, parse_config
from router.errors import ConfigError
from tests.ports import free_port
from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, make_config

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
PATH_KEYS = ["health_path", "load_path", "snapshot_path"]


def config_with_worker(**worker: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "m", "block_size": 16}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:8001", "model": "m", **worker}],
        "admin": {"token": "t"},
    }


@pytest.mark.unit
@pytest.mark.parametrize("key", PATH_KEYS)
@pytest.mark.parametrize("path", ["health", "", "v1/load", "http://other:1/x"])
def test_a_path_without_a_leading_slash_is_refused_naming_the_key(key: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config_with_worker(**{key: path}))
    assert info.value.message == f"config: {key} must start with '/', got {path!r} - at `$.workers[0]`"
    with pytest.raises(ConfigError) as info:
        decode_worker({"id": "w0", "url": "http://127.0.0.1:8001", "model": "m", key: path})
    assert info.value.message == f"worker: {key} must start with '/', got {path!r}"


@pytest.mark.unit
def test_paths_with_a_leading_slash_or_none_load() -> None:
    worker = parse_config(config_with_worker(health_path="/healthz", load_path=None, snapshot_path="/a/b?c=1"))
    assert (worker.workers[0].health_path, worker.workers[0].load_path, worker.workers[0].snapshot_path) == (
        "/healthz", None, "/a/b?c=1")


@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.parametrize("key", PATH_KEYS)
async def test_admin_add_with_a_path_without_a_leading_slash_is_a_400_and_adds_nothing(key: str) -> None:
    w0 = FakeWorker("w0", with_events=False)
    await w0.start()
    try:
        async with GatewayHarness(make_config([w0])) as h:
            entry = {"id": "w9", "url": w0.url, "model": "m", key: "health"}
            status, body = await h.admin("POST", "/admin/workers", entry)
            assert (status, body) == (400, {"error": {
                "message": f"worker: {key} must start with '/', got 'health'", "type": "invalid_request_error",
                "param": None, "code": None}})
            status, body = await h.admin("GET", "/admin/workers")
            assert [w["id"] for w in body["workers"]] == ["w0"]
    finally:
        await w0.stop()


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def _serve_errors(config: Path, *, preexec_fn: Callable[[], None] | None = None) -> list[str]:
    """``kvgate serve --config config``, which must exit 2 without a traceback: its ERROR lines (level onwards)."""
    proc = subprocess.run(
        ["timeout", "60", sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=90, preexec_fn=preexec_fn,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    return [line.split(" ", 2)[2] for line in proc.stderr.splitlines() if " ERROR " in line]


@pytest.mark.integration
def test_serve_with_workers_over_the_rank_stream_capacity_exits_2_with_one_line_naming_the_limit(tmp_path):
    """Two workers of 256 dp ranks each (more than libzmq's default 1,023 sockets once allowed) need more
    descriptors than an open-files limit of 1,024 gives: the start is refused before any subscription, naming the
    limit (``events.capacity``)."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"listen: {{host: {HOST}, port: {free_port()}}}\n"
        "models: [{name: m, block_size: 16}]\n"
        "workers:\n"
        f'  - {{id: w0, url: "http://{HOST}:{free_port()}", model: m, events_endpoint: "tcp://{HOST}:20000", '
        "dp_ranks: 256, load_path: null, snapshot_path: null}\n"
        f'  - {{id: w1, url: "http://{HOST}:{free_port()}", model: m, events_endpoint: "tcp://{HOST}:21000", '
        "dp_ranks: 256, load_path: null, snapshot_path: null}\n"
        "admin: {disable_auth: true}\n",
        encoding="utf-8",
    )
    errors = _serve_errors(config, preexec_fn=_limit_open_files)
    assert errors == [
        "ERROR router.serve: workers: 512 KV event rank streams (the workers' dp_ranks) are more than this process "
        "can follow: the open-files limit (RLIMIT_NOFILE) is 1024 (4 descriptors a rank stream, 512 reserved): 128 "
        "rank streams; raise it with `ulimit -n` or the container's nofile limit"]


@pytest.mark.integration
def test_serve_with_an_events_endpoint_zmq_refuses_names_the_worker_and_the_key(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"listen: {{host: {HOST}, port: {free_port()}}}\n"
        "models: [{name: m, block_size: 16}]\n"
        "workers:\n"
        f'  - {{id: w0, url: "http://{HOST}:{free_port()}", model: m, events_endpoint: "udp://{HOST}:5"}}\n'
        "admin: {disable_auth: true}\n",
        encoding="utf-8",
    )
    errors = _serve_errors(config)
    assert errors == [
        f"ERROR router.serve: worker 'w0': events_endpoint: cannot connect udp://{HOST}:5: The protocol is not "
        f"compatible with the socket type (addr='udp://{HOST}:5')"
    ]


@pytest.mark.unit
@pytest.mark.parametrize("pool", ["CPU", "DISK", "cpu_pinned", "GPU", "nope", ""])
def test_a_pool_that_is_not_a_shared_tier_is_refused_naming_the_key(pool: str) -> None:
    """A worker's own tier as a pool made the worker fail to start (the index refuses CPU as a pool); an unknown
    name was ignored without a word."""
    expected = (f"pools: {pool!r} is not a shared pool tier; the shared tier is MOONCAKE (also named EXTERNAL, "
                "STORAGE or L3)")
    with pytest.raises(ConfigError) as info:
        parse_config(config_with_worker(pools=["MOONCAKE", pool]))
    assert info.value.message == f"config: {expected} - at `$.workers[0]`"
    with pytest.raises(ConfigError) as info:
        decode_worker({"id": "w0", "url": "http://127.0.0.1:8001", "model": "m", "pools": [pool]})
    assert info.value.message == f"worker: {expected}"


@pytest.mark.unit
def test_the_shared_tier_under_each_of_its_names_loads() -> None:
    config = parse_config(config_with_worker(pools=["MOONCAKE", "mooncake", "EXTERNAL", "STORAGE", "L3"]))
    assert config.workers[0].pools == ("MOONCAKE", "mooncake", "EXTERNAL", "STORAGE", "L3")


@pytest.mark.integration
@pytest.mark.asyncio
async def test_admin_add_with_a_worker_tier_as_pool_is_a_400_and_adds_nothing() -> None:
    w0 = FakeWorker("w0", with_events=False)
    await w0.start()
    try:
        async with GatewayHarness(make_config([w0])) as h:
            entry = {"id": "w9", "url": w0.url, "model": "m", "pools": ["CPU"]}
            status, body = await h.admin("POST", "/admin/workers", entry)
            assert (status, body["error"]["message"]) == (400, (
                "worker: pools: 'CPU' is not a shared pool tier; the shared tier is MOONCAKE (also named EXTERNAL, "
                "STORAGE or L3)"))
            status, body = await h.admin("GET", "/admin/workers")
            assert [w["id"] for w in body["workers"]] == ["w0"]
    finally:
        await w0.stop()
