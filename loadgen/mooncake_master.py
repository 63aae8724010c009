"""A real ``mooncake_master`` on 127.0.0.1 for the load generator, benchmarks and tests: started, killed and
restarted on the same ports."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from loadgen.ports import PortPicker


def master_binary() -> str | None:
    """The ``mooncake_master`` of this environment, or ``None``."""
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    return binary if Path(binary).exists() else None


class MooncakeMaster:
    """One master process: RPC on ``rpc_port``, HTTP admin (metrics, key listing) on ``admin_port``.

    Args:
        lease_ttl_ms: ``--default_kv_lease_ttl``.
        extra_args: further flags (eviction watermarks...).
        free_port: picks the two ports (tests pass theirs, so no fixture gets the same port).
    """

    def __init__(
        self,
        lease_ttl_ms: int = 2000,
        extra_args: tuple[str, ...] = (),
        free_port: Callable[[], int] | None = None,
    ) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master is not installed")
        self.binary = binary
        pick = free_port or PortPicker().port
        self.rpc_port = pick()
        self.admin_port = pick()
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start it and wait until its RPC and admin ports answer.

        Raises:
            RuntimeError: it did not come up in ``timeout_s``.
        """
        self.proc = subprocess.Popen(  # noqa: S603 - a fixed binary, no shell
            [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.admin_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
                urllib.request.urlopen(self.admin_url + "/metrics", timeout=1).close()  # noqa: S310 - loopback
                return
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError("mooncake_master did not start")

    def kill(self) -> None:
        """SIGKILL (a crash: nothing it held survives)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """Terminate (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def metric(self, name: str) -> float:
        """One unlabelled sample of ``GET /metrics``."""
        with urllib.request.urlopen(self.admin_url + "/metrics", timeout=5) as resp:  # noqa: S310 - loopback
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def keys(self) -> list[str]:
        """``GET /get_all_keys``."""
        with urllib.request.urlopen(self.admin_url + "/get_all_keys", timeout=5) as resp:  # noqa: S310 - loopback
            return [k for k in resp.read().decode().splitlines() if k]
