"""One port picker for the whole test run, so no two fixtures get the same port (see ``loadgen.ports``)."""

from __future__ import annotations

from loadgen.ports import PortPicker

_PICKER = PortPicker()


def free_port() -> int:
    """A TCP port free on 127.0.0.1, outside the ephemeral range, not handed out before in this run."""
    return _PICKER.port()
