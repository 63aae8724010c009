"""A Redis that ``benchmarks.chaos`` stops and starts again under load: the protocol the run needs and a local
``redis-server`` process that meets it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Protocol


class RestartableRedis(Protocol):
    """A Redis the run may stop and start again on the same port (``RedisProcess``, the tests' ``RedisServer``)."""

    @property
    def url(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class RedisProcess:
    """A ``redis-server`` without persistence on 127.0.0.1, stoppable and restartable on the same port."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - kept by the child
        self._proc = subprocess.Popen(  # noqa: S603
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        self._proc = None
