"""A real ``redis-server`` for tests, on a free 127.0.0.1 port in a temporary directory.

Use from any test folder's ``conftest.py``::

    from tests.redis_server import redis_key_prefix, redis_url, restartable_redis  # noqa: F401

Fixtures:
    redis_url: URL of one server shared by the whole test session: ``KVGATE_TEST_REDIS_URL`` when set (an
        external server, never stopped), else a ``redis-server`` started here.
    redis_key_prefix: a prefix unique to the test (``kvgate-test:<n>:``), so tests never see each other's keys
        and nothing needs flushing.
    restartable_redis: a private server for one test that the test may ``stop()`` and ``start()`` again on the
        same port (always a local ``redis-server``; skipped when the binary is absent).

Tests needing a server are skipped, with the reason, when ``redis-server`` is not installed and no
``KVGATE_TEST_REDIS_URL`` is set (``scripts/test`` installs it).
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port

ENV_URL = "KVGATE_TEST_REDIS_URL"
_START_TIMEOUT_S = 10.0
_prefix_counter = itertools.count()




def _ping(port: int, password: str | None) -> bool:
    """True when a server on ``port`` answers PING with PONG (raw RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if password is not None:
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password.encode()))
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process without persistence, bound to 127.0.0.1.

    Attributes:
        port: the TCP port (kept across ``stop()``/``start()``).
        password: ``requirepass`` value, or ``None``.
        directory: working directory (log file ``redis.log``).
    """

    def __init__(self, directory: Path, password: str | None = None, port: int | None = None) -> None:
        self.directory = directory
        self.password = password
        self.port = port if port is not None else free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (without the password; pass it separately)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server and wait (bounded) until it answers PING.

        Raises:
            RuntimeError: it did not answer within the deadline (its log is in the message).
        """
        if self.is_running:
            return
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        argv = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--logfile", "redis.log", "--daemonize", "no"]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            if _ping(self.port, self.password):
                return
            time.sleep(0.02)
        self.stop()
        log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server on port {self.port} did not start: {log}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and wait for it to exit."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5.0)


def _require_binary() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/test installs it; or set KVGATE_TEST_REDIS_URL)")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis shared by the whole test session."""
    external = os.environ.get(ENV_URL)
    if external:
        yield external
        return
    _require_binary()
    with tempfile.TemporaryDirectory(prefix="kvgate-redis-") as directory:
        server = RedisServer(Path(directory))
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def redis_key_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses."""
    return f"kvgate-test:{os.getpid()}:{next(_prefix_counter)}:"


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private server this test may stop and start again (same port)."""
    _require_binary()
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def make_redis_server(directory: Path, password: str | None = None) -> RedisServer:
    """A ``RedisServer`` not yet started (for tests that need a password or several servers); skips without
    the binary."""
    _require_binary()
    return RedisServer(directory, password=password)
