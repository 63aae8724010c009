"""``kvgate serve`` start-up: an address it cannot bind is one error line and exit status 2, with nothing left
running; a model without ``tokenizer_path`` gets one warning."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import main
from router.config import parse_config
from router.serve import warn_byte_level_tokenizers
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"

BYTE_LEVEL_WARNING = (
    "model {name} has no tokenizer_path: prompts are tokenized byte-level, which matches only the bundled sim "
    "worker (kvgate worker); for a real engine (vLLM, SGLang) set models[].tokenizer_path (and chat_template if "
    "the engine uses a custom one) and block_size to the engine's, or cached-token predictions will not match"
)


def write_config(tmp_path: Path, *, listen_port: int, events_bind_port: int | None = None) -> Path:
    """A gateway config with one worker whose KV events the gateway would subscribe to if it started."""
    events = "" if events_bind_port is None else f'events: {{bind_endpoint: "tcp://{HOST}:{events_bind_port}"}}\n'
    path = tmp_path / "gateway.yaml"
    path.write_text(
        f"listen: {{host: {HOST}, port: {listen_port}}}\n"
        "models: [{name: m, block_size: 16}]\n"
        "workers:\n"
        f'  - {{id: w0, url: "http://{HOST}:{free_port()}", model: m, events_endpoint: "tcp://{HOST}:{free_port()}"}}\n'
        "admin: {disable_auth: true}\n" + events,
        encoding="utf-8",
    )
    return path


# Runs ``kvgate serve`` twice in a fresh interpreter (the first call takes imports and first-use allocations out of
# the count) and prints the exit statuses, the second call's error lines and every descriptor it left open, with its
# target (a socket the first call left listening would make the second fail on the port instead). A fresh
# interpreter, because in the test process other tests' background threads (a Mooncake client pinging its master, a
# Redis pool) open and close sockets of their own at any moment.
FD_CHECK = """
import json, logging, os, sys
from router.cli import main
def fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out
class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())
args = ["serve", "--config", sys.argv[1]]
first = main(args)
errors = Errors()
logging.getLogger().handlers[:] = [errors]
before = fds()
second = main(args)
left = {fd: target for fd, target in fds().items() if before.get(fd) != target}
print(json.dumps({"statuses": [first, second], "errors": errors.lines, "left_open": left}))
"""


def fds_left_by_second_serve(config: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", FD_CHECK, str(config)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def messages(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, str]]:
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.integration
def test_taken_port_is_one_error_line_exit_2_and_no_traceback(tmp_path, held_port):
    config = write_config(tmp_path, listen_port=held_port)
    proc = subprocess.run(
        ["timeout", "60", sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    # Strip the timestamp ("2024-01-01 12:00:00,000 "): level, logger and message remain.
    lines = [line.split(" ", 2)[2] for line in proc.stderr.splitlines()]
    assert [line for line in lines if not line.startswith("INFO ")] == [
        "WARNING router.serve: " + BYTE_LEVEL_WARNING.format(name="m"),
        f"ERROR router.serve: cannot listen on {HOST}:{held_port}: address already in use "
        "(another process holds it; pick another listen.port or --port)",
    ]
    # The port is bound before the app starts: no KV event subscription, no worker was started.
    assert not [line for line in lines if line.startswith(("INFO events.", "INFO router.fleet"))]


@pytest.mark.integration
def test_taken_port_starts_nothing_and_leaks_nothing(tmp_path, held_port, caplog):
    config = write_config(tmp_path, listen_port=held_port)
    with caplog.at_level(logging.INFO):
        status = main(["serve", "--config", str(config)])
    assert status == 2
    error = (
        f"cannot listen on {HOST}:{held_port}: address already in use "
        "(another process holds it; pick another listen.port or --port)"
    )
    assert messages(caplog)[-1] == ("router.serve", logging.ERROR, error)
    # The port is bound before the app starts: no subscription, no worker, no listener was ever started.
    assert not [r for r in caplog.records if r.name in ("events.subscriber", "events.rank_stream", "router.fleet")]
    assert fds_left_by_second_serve(config) == {"statuses": [2, 2], "errors": [error], "left_open": {}}


@pytest.mark.integration
def test_port_flag_names_the_flag_too(tmp_path, held_port, caplog):
    config = write_config(tmp_path, listen_port=free_port())
    status = main(["serve", "--config", str(config), "--host", HOST, "--port", str(held_port)])
    assert status == 2
    assert messages(caplog)[-1][2] == (
        f"cannot listen on {HOST}:{held_port}: address already in use "
        "(another process holds it; pick another listen.port or --port)"
    )


@pytest.mark.integration
def test_taken_events_bind_endpoint_is_one_error_line_exit_2(tmp_path, held_port, caplog):
    listen_port = free_port()
    config = write_config(tmp_path, listen_port=listen_port, events_bind_port=held_port)
    status = main(["serve", "--config", str(config)])
    assert status == 2
    assert messages(caplog)[-1] == (
        "router.serve",
        logging.ERROR,
        f"cannot bind events.bind_endpoint tcp://{HOST}:{held_port}: address already in use "
        "(another process holds it; pick another port in events.bind_endpoint)",
    )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # the HTTP listener was closed again
        sock.bind((HOST, listen_port))


@pytest.mark.integration
def test_failed_start_closes_what_had_started(tmp_path, caplog):
    """The second worker is refused after the subscriber started and the first worker's warm-up began."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"listen: {{host: {HOST}, port: {free_port()}}}\n"
        "models: [{name: m}]\n"
        "workers:\n"
        f'  - {{id: w0, url: "http://{HOST}:{free_port()}", model: m, events_endpoint: "tcp://{HOST}:{free_port()}"}}\n'
        f'  - {{id: w1, url: "http://{HOST}:{free_port()}", model: m, events_endpoint: "tcp://{HOST}:x"}}\n'
        "admin: {disable_auth: true}\n",
        encoding="utf-8",
    )
    assert main(["serve", "--config", str(config)]) == 2
    error = f"worker 'w1': events_endpoint: cannot connect tcp://{HOST}:x: Invalid argument (addr='tcp://{HOST}:x')"
    assert messages(caplog)[-1] == ("router.serve", logging.ERROR, error)
    assert fds_left_by_second_serve(config) == {"statuses": [2, 2], "errors": [error], "left_open": {}}


@pytest.mark.unit
def test_one_warning_per_byte_level_model(tmp_path, caplog):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}", encoding="utf-8")
    config = parse_config(
        {
            "models": [{"name": "a"}, {"name": "b", "tokenizer_path": str(tokenizer)}, {"name": "c"}],
            "admin": {"disable_auth": True},
        }
    )
    warn_byte_level_tokenizers(config)
    assert messages(caplog) == [
        ("router.serve", logging.WARNING, BYTE_LEVEL_WARNING.format(name="a")),
        ("router.serve", logging.WARNING, BYTE_LEVEL_WARNING.format(name="c")),
    ]


def test_version_flag_prints_the_package_version(capsys):
    import importlib.metadata

    from router.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"kvgate {importlib.metadata.version('kvgate')}\n"
