"""``kvgate serve --processes N``: N gateways listen on one port (SO_REUSEPORT), all answer, one signal stops all;
configurations several processes cannot share are refused with one error line and status 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.ports import free_port
from tests.redis_server import redis_key_prefix, redis_url  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
pytestmark = pytest.mark.integration


def _listeners(port: int) -> int:
    """LISTEN sockets on ``port`` in /proc/net/tcp (state 0A)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
            count += 1
    return count


def _config(tmp_path: Path, port: int, worker_port: int, **extra: object) -> Path:
    cfg = {"listen": {"host": HOST, "port": port}, "models": [{"name": "m", "block_size": 16}],
           "workers": [{"id": "w0", "url": f"http://{HOST}:{worker_port}", "model": "m", "load_path": None,
                        "snapshot_path": None}],
           "admin": {"disable_auth": True}, **extra}
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(cfg))
    return path


def test_two_processes_share_the_port_answer_and_stop_on_one_signal(tmp_path: Path, redis_url: str,  # noqa: F811
                                                                   redis_key_prefix: str) -> None:  # noqa: F811
    port, worker_port = free_port(), free_port()
    sessions = {"store": "redis", "url": redis_url, "key_prefix": redis_key_prefix}
    backend = subprocess.Popen([sys.executable, "-m", "benchmarks.gateway", "--role", "backend", "--ports",
                                str(worker_port)], cwd=REPO)
    gateway = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config",
                                str(_config(tmp_path, port, worker_port, sessions=sessions)), "--processes", "2",
                                "--log-level", "WARNING"], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while _listeners(port) < 2:
            assert time.monotonic() < deadline, "two listeners did not come up"
            assert gateway.poll() is None
            time.sleep(0.2)
        assert _listeners(port) == 2
        statuses = []
        for _ in range(20):  # a new connection each: the kernel spreads them over both processes
            body = {"model": "m", "prompt": "hi " * 50, "user": "u1"}
            r = requests.post(f"http://{HOST}:{port}/v1/completions", json=body, headers={"Connection": "close"},
                              timeout=30)
            statuses.append(r.status_code)
        assert statuses == [200] * 20
        import redis

        keys = redis.Redis.from_url(redis_url).keys(redis_key_prefix + "*")
        assert len(keys) >= 1  # the one session, claimed in the shared store by whichever process took it
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=60) == 0
        assert _listeners(port) == 0
    finally:
        for proc in (gateway, backend):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


def test_a_bind_topology_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path, free_port(), free_port(), events={"bind_endpoint": f"tcp://{HOST}:{free_port()}"})
    proc = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--processes", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--processes needs the connect topology: events.bind_endpoint is one SUB socket" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_session_sticky_without_redis_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path, free_port(), free_port())
    proc = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--processes", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--processes with the session_sticky policy needs sessions.store: redis" in proc.stderr
