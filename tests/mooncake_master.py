"""A real ``mooncake_master`` for tests: ``loadgen.mooncake_master.MooncakeMaster`` on free 127.0.0.1 ports
(``tests.ports``), started for the test and stopped after it; the test is skipped when the binary is not installed
(the ``mooncake`` extra).

Use in a fixture or a test::

    with running_master(lease_ttl_ms=2000) as master:
        ...  # master.address (RPC), master.admin_url (metrics, key listing), master.kill() / start()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from loadgen.mooncake_master import MooncakeMaster, master_binary
from tests.ports import free_port


@contextmanager
def running_master(lease_ttl_ms: int, extra_args: tuple[str, ...] = ()) -> Iterator[MooncakeMaster]:
    """A started master with leases of ``lease_ttl_ms`` and ``extra_args`` (eviction watermarks...), stopped on exit.

    Raises:
        RuntimeError: it did not come up (``MooncakeMaster.start``).
    """
    if master_binary() is None:
        pytest.skip("mooncake_master not installed")
    master = MooncakeMaster(lease_ttl_ms=lease_ttl_ms, extra_args=extra_args, free_port=free_port)
    master.start()
    try:
        yield master
    finally:
        master.stop()
