"""``kvgate serve --processes N``: N gateway processes on one port, one core each.

A single asyncio process uses one core. This runs N full gateways (``router.serve``), each listening on the same
address with ``SO_REUSEPORT`` so the kernel spreads new connections over them (by a hash of the connection's
addresses: a client's keep-alive connection stays with one process). What each process does and why it is
consistent:

* **Events**: every process subscribes to every worker's KV events itself (the ``connect`` topology: each opens
  its own SUB to each worker's PUB, as separate replicas do), so each index converges to the same state within the
  event latency. A ``bind`` topology (``events.bind_endpoint``: workers connect to one SUB) serves one process
  only, so it is refused here.
* **Sessions**: a session's owner lives in the session store. With ``sessions.store: redis`` every process reads
  and claims the same owner (compare-and-set), so a conversation stays on its worker whichever process gets its
  turns; with the in-memory store each process would keep its own owners, so ``session_sticky`` with several
  processes needs Redis and is refused otherwise.
* **Predicted entries** (the blocks a process records for its own routed request until the worker's events
  confirm them) stay in that process. Another process sees the same blocks when the worker's ``BlockStored``
  arrives (after the prefill: tens to hundreds of ms later), so only requests of one *new* prefix arriving at
  different processes within that window can miss each other's placement; turns of one session are sticky
  through the store and unaffected.

The parent picks the port (``listen.port`` 0 is resolved once, so all processes share it), starts the children
(``kvgate serve --reuse-port``), forwards ``SIGINT``/``SIGTERM`` to them, and stops them all when one exits,
returning that child's status.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from policies import SessionStickyConfig
from router.config import GatewayConfig

logger = logging.getLogger(__name__)


def check_processes_config(config: GatewayConfig, num_processes: int) -> str | None:
    """Why ``config`` cannot run as ``num_processes`` processes, or ``None`` when it can."""
    if num_processes <= 1:
        return None
    if config.events.bind_endpoint is not None:
        return ("--processes needs the connect topology: events.bind_endpoint is one SUB socket, which one process "
                "only can bind; give each worker its events_endpoint instead")
    if isinstance(config.policy, SessionStickyConfig) and config.sessions.store != "redis":
        return ("--processes with the session_sticky policy needs sessions.store: redis, so every process sees "
                "the same session owners")
    return None


def _resolve_port(host: str, port: int) -> int:
    """``port``, or for 0 a free port of ``host`` that every process then binds with ``SO_REUSEPORT``."""
    if port != 0:
        return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host or "0.0.0.0", 0))
        return int(sock.getsockname()[1])


def serve_processes(args: argparse.Namespace, config: GatewayConfig) -> int:
    """Run ``args.processes`` gateways on one port until a signal or until one exits; returns the exit status.

    Returns:
        0 after a signal stopped them all; else the status of the first child that exited (2: a bad config or
        an address in use, as ``kvgate serve`` itself answers).
    """
    reason = check_processes_config(config, args.processes)
    if reason is not None:
        logger.error("%s", reason)
        return 2
    host = args.host if args.host is not None else config.listen.host
    port = _resolve_port(host, args.port if args.port is not None else config.listen.port)
    command = [sys.executable, "-m", "router.cli", "serve", "--config", str(args.config), "--port", str(port),
               "--reuse-port", "--log-level", str(args.log_level)]
    if args.host is not None:
        command += ["--host", args.host]
    children = [subprocess.Popen(command) for _ in range(args.processes)]
    logger.info("kvgate: %d gateway processes on port %d (pids %s)", len(children), port,
                ", ".join(str(c.pid) for c in children))
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = 0
        while True:
            exited = [c for c in children if c.poll() is not None]
            if exited:
                status = 0 if stopping else int(exited[0].returncode or 0)
                if not stopping:
                    logger.error("gateway process %d exited with status %s; stopping the others", exited[0].pid,
                                 exited[0].returncode)
                    stop(signal.SIGTERM, None)
                break
            time.sleep(0.2)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
