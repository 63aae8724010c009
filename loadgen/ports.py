"""Free TCP ports on 127.0.0.1 for the processes a demo, a benchmark or a test starts.

A port the OS hands out for ``bind(("127.0.0.1", 0))`` comes from the ephemeral range, the same range the OS uses
for every outgoing connection; between the moment it is picked and the moment a child process binds it, any
connection on the machine (a health poll, a worker's own RPC sockets) may take it. :class:`PortPicker` therefore
picks below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range`` on Linux), checks that the port binds,
and never hands out one port twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST_PORT = 10000
_MAX_ATTEMPTS = 1000


def ephemeral_port_range() -> tuple[int, int]:
    """The OS's ephemeral port range ``(low, high)``, inclusive; Linux's default where it cannot be read."""
    try:
        low, high = (int(part) for part in _LOCAL_PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


class PortPicker:
    """Hands out distinct ports that are free on 127.0.0.1 and outside the ephemeral range.

    Args:
        seed: seed of the random choice (``None``: from the OS), so concurrent runs spread over the range.
    """

    def __init__(self, seed: int | None = None) -> None:
        low, high = ephemeral_port_range()
        if low - _LOWEST_PORT >= 2000:
            self._candidates = range(_LOWEST_PORT, low)
        else:
            self._candidates = range(high + 1, 65536)
        self._random = random.Random(seed)
        self._handed_out: set[int] = set()

    def port(self) -> int:
        """A port nobody is bound to now and that this picker has not handed out before.

        Raises:
            RuntimeError: no free port found after many attempts.
        """
        for _ in range(_MAX_ATTEMPTS):
            port = self._random.choice(self._candidates)
            if port not in self._handed_out and _binds(port):
                self._handed_out.add(port)
                return port
        raise RuntimeError(f"no free TCP port on {HOST} in {self._candidates}")

    def ports(self, count: int) -> list[int]:
        """``count`` distinct free ports."""
        return [self.port() for _ in range(count)]
