import socket

import pytest

from loadgen.ports import PortPicker, ephemeral_port_range

pytestmark = pytest.mark.unit


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low, high = ephemeral_port_range()
    ports = PortPicker(seed=7).ports(200)
    assert len(set(ports)) == 200
    assert all(p < low or p > high for p in ports)
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_bound_port_is_never_handed_out():
    first = PortPicker(seed=3).port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", first))
        assert PortPicker(seed=3).port() != first
