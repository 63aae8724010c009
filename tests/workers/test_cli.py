"""``kvgate worker``: an HTTP port or a ZMQ endpoint it cannot bind is one error line and exit status 2, with
everything it had bound released; ``--help`` says what ``--time-scale`` means here."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ListenError
from common.listen import bind_tcp, listen_address, zmq_bind_message
from events.errors import EventsConfigError
from router.cli import main
from tests.ports import free_port
from workers.cli import add_arguments

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def assert_free(port: int) -> None:
    """Nothing listens on ``port`` any more: a plain socket (no ``SO_REUSEADDR``) binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, port))


def open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def errors(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.integration
def test_taken_http_port_is_one_error_line_exit_2_and_no_traceback(held_port):
    proc = subprocess.run(
        ["timeout", "60", sys.executable, "-m", "router.cli", "worker", "--port", str(held_port), "--time-scale", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    # Strip the timestamp ("2024-01-01 12:00:00,000 "): level, logger and message remain.
    assert [line.split(" ", 2)[2] for line in proc.stderr.splitlines()] == [
        f"ERROR workers.cli: cannot listen on {HOST}:{held_port}: address already in use "
        "(another process holds it; pick another --port)"
    ]


@pytest.mark.integration
def test_taken_http_port_binds_no_event_endpoint(held_port, caplog):
    events_port = free_port()
    argv = ["worker", "--port", str(held_port), "--kv-events-endpoint", f"tcp://*:{events_port}", "--time-scale", "0"]
    assert main(argv) == 2  # imports and first-use allocations out of the count
    fds_before = open_fds()
    caplog.clear()
    assert main(argv) == 2
    assert errors(caplog) == [
        ("workers.cli", f"cannot listen on {HOST}:{held_port}: address already in use "
                        "(another process holds it; pick another --port)")
    ]
    assert open_fds() == fds_before
    assert_free(events_port)


@pytest.mark.integration
def test_taken_events_endpoint_is_one_error_line_exit_2(held_port, caplog):
    http_port = free_port()
    argv = ["worker", "--port", str(http_port), "--kv-events-endpoint", f"tcp://*:{held_port}", "--time-scale", "0"]
    assert main(argv) == 2
    fds_before = open_fds()
    caplog.clear()
    assert main(argv) == 2
    assert errors(caplog) == [
        ("workers.cli", f"cannot bind --kv-events-endpoint tcp://*:{held_port}: address already in use "
                        "(another process holds it; pick another port in --kv-events-endpoint)")
    ]
    assert open_fds() == fds_before
    assert_free(http_port)


@pytest.mark.integration
def test_taken_replay_endpoint_releases_the_http_port_and_the_pub(held_port, caplog):
    http_port, events_port = free_port(), free_port()
    argv = [
        "worker", "--port", str(http_port), "--kv-events-endpoint", f"tcp://*:{events_port}",
        "--replay-endpoint", f"tcp://*:{held_port}", "--time-scale", "0",
    ]
    assert main(argv) == 2
    fds_before = open_fds()
    caplog.clear()
    assert main(argv) == 2
    assert errors(caplog) == [
        ("workers.cli", f"cannot bind --replay-endpoint tcp://*:{held_port}: address already in use "
                        "(another process holds it; pick another port in --replay-endpoint)")
    ]
    assert open_fds() == fds_before
    assert_free(http_port)
    assert_free(events_port)


@pytest.mark.integration
def test_bind_tcp_listens_on_the_port_it_names():
    port = free_port()
    sockets = bind_tcp(HOST, port, port_names="--port", host_names="--host")
    try:
        assert [listen_address(s) for s in sockets] == [f"{HOST}:{port}"]
        assert [s.getblocking() for s in sockets] == [False]
        with socket.create_connection((HOST, port), timeout=5):  # listening: the kernel accepts the connection
            pass
    finally:
        for sock in sockets:
            sock.close()
    assert_free(port)


@pytest.mark.integration
def test_bind_tcp_names_a_foreign_address():
    with pytest.raises(ListenError) as info:
        bind_tcp("192.0.2.1", 8000, port_names="--port", host_names="--host")  # TEST-NET-1: on no interface
    assert str(info.value) == (
        "cannot listen on 192.0.2.1:8000: address not available (no interface of this machine has it; "
        "set another --host)"
    )


@pytest.mark.integration
def test_bind_tcp_brackets_ipv6_addresses(held_port):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("::1", held_port))
        except OSError as exc:
            pytest.skip(f"cannot bind ::1: {exc}")
        sock.listen()
        with pytest.raises(ListenError) as info:
            bind_tcp("::1", held_port, port_names="listen.port or --port", host_names="listen.host or --host")
    assert str(info.value) == (
        f"cannot listen on [::1]:{held_port}: address already in use (another process holds it; pick another "
        "listen.port or --port)"
    )


@pytest.mark.unit
def test_zmq_message_without_an_endpoint_keeps_the_error_text():
    exc = EventsConfigError("dp_rank must be >= 0, got -1")
    assert zmq_bind_message(exc, "--kv-events-endpoint") == "--kv-events-endpoint: dp_rank must be >= 0, got -1"


@pytest.mark.unit
def test_time_scale_help_says_wall_seconds_per_simulated_second():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    [action] = [a for a in parser._actions if "--time-scale" in a.option_strings]
    assert action.help == (
        "wall seconds the worker sleeps per simulated second: 1 runs in real time, 0.1 runs 10x faster (pair it "
        "with the gateway's workers[].time_scale: 0.1 and with kvgate loadgen/demo --time-scale 10, where the flag "
        "means 'times faster'), 0 does not sleep"
    )
