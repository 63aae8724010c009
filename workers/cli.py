"""``kvgate worker``: run a reference worker.

Flags override the YAML profile (``--profile``), which overrides the defaults of ``workers.config``. The shared
pool tier (``kv-cache.pool``) is enabled by any ``--pool-*`` / ``--mooncake-*`` flag, e.g.
``--pool-backend mooncake --mooncake-master 127.0.0.1:50051`` or ``--pool-backend sim --pool-name fleet-a``.

Start-up binds the HTTP port first, then the KV event endpoints, then starts the engine loop; an address that
cannot be bound (a port another process holds) stops whatever had started and exits with status 2 and one error
line naming the address and the flag to change, as a bad value does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web

from common.errors import CommonError
from common.listen import BACKLOG, bind_tcp, listen_address, zmq_bind_message
from events.errors import EventsConfigError
from events.publisher import KVEventPublisher
from workers.config import WorkerConfig, build_config, load_profile
from workers.errors import ConfigError, WorkerError
from workers.server import build_app, build_worker, make_publisher

logger = logging.getLogger(__name__)

# (flag, config path, type)
FLAGS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("--worker-id", ("worker-id",), str),
    ("--model", ("model",), str),
    ("--host", ("host",), str),
    ("--port", ("port",), int),
    ("--engine", ("engine",), str),
    ("--role", ("role",), str),
    ("--kv-transfer-engine-id", ("kv-transfer", "engine-id"), str),
    ("--kv-transfer-host", ("kv-transfer", "advertise-host"), str),
    ("--kv-transfer-abort-timeout-s", ("kv-transfer", "abort-request-timeout-s"), float),
    ("--kv-transfer-pull-timeout-s", ("kv-transfer", "pull-timeout-s"), float),
    ("--kv-events-endpoint", ("kv-events-endpoint",), str),
    ("--replay-endpoint", ("replay-endpoint",), str),
    ("--kv-events-topic", ("kv-events-topic",), str),
    ("--tokenizer", ("tokenizer",), str),
    ("--time-scale", ("time-scale",), float),
    ("--num-gpu-blocks", ("kv-cache", "num-gpu-blocks"), int),
    ("--num-cpu-blocks", ("kv-cache", "num-cpu-blocks"), int),
    ("--block-size", ("kv-cache", "block-size"), int),
    ("--cpu-store-policy", ("kv-cache", "cpu-store-policy"), str),
    ("--pool-backend", ("kv-cache", "pool", "backend"), str),
    ("--pool-name", ("kv-cache", "pool", "name"), str),
    ("--pool-capacity-blocks", ("kv-cache", "pool", "capacity-blocks"), int),
    ("--pool-store-policy", ("kv-cache", "pool", "store-policy"), str),
    ("--mooncake-master", ("kv-cache", "pool", "master-address"), str),
    ("--mooncake-metadata-server", ("kv-cache", "pool", "metadata-server"), str),
    ("--mooncake-local-hostname", ("kv-cache", "pool", "local-hostname"), str),
    ("--mooncake-protocol", ("kv-cache", "pool", "protocol"), str),
    ("--mooncake-global-segment-size", ("kv-cache", "pool", "global-segment-size"), int),
    ("--mooncake-local-buffer-size", ("kv-cache", "pool", "local-buffer-size"), int),
    ("--mooncake-lease-ttl-s", ("kv-cache", "pool", "lease-ttl-s"), float),
    ("--pool-value-bytes-per-block", ("kv-cache", "pool", "value-bytes-per-block"), int),
    ("--pool-num-layer-groups", ("kv-cache", "pool", "num-layer-groups"), int),
    ("--pool-verify", ("kv-cache", "pool", "verify"), str),
    ("--pool-blocks-per-span", ("kv-cache", "pool", "blocks-per-span"), int),
    ("--max-num-seqs", ("scheduler", "max-num-seqs"), int),
    ("--max-num-batched-tokens", ("scheduler", "max-num-batched-tokens"), int),
    ("--max-model-len", ("scheduler", "max-model-len"), int),
    ("--long-prefill-token-threshold", ("scheduler", "long-prefill-token-threshold"), int),
)


HELP: dict[str, str] = {
    "--host": "HTTP listen address (default 127.0.0.1)",
    "--role": "prefill | decode | both (default): which leg of a disaggregated request this worker serves",
    "--kv-transfer-host": "host decode workers pull this worker's KV from (default: --host)",
    "--port": "HTTP port (default 8000; 0 picks a free one)",
    "--kv-events-endpoint": "ZMQ PUB endpoint of the KV events; with '*' (tcp://*:5557) it binds, else it connects",
    "--replay-endpoint": "ZMQ ROUTER endpoint (bound) answering replay requests after a gap",
    "--tokenizer": "tokenizer.json or its directory (default: byte-level tokens); the gateway's "
    "models[].tokenizer_path must name the same tokenizer",
    "--time-scale": "wall seconds the worker sleeps per simulated second: 1 runs in real time, 0.1 runs 10x faster "
    "(pair it with the gateway's workers[].time_scale: 0.1 and with kvgate loadgen/demo --time-scale 10, where "
    "the flag means 'times faster'), 0 does not sleep",
    "--long-prefill-token-threshold": "tokens one request computes per step at most (vLLM's flag of the same name; "
    "default 0: only --max-num-batched-tokens caps it); tell the gateway's cache_aware policy the same value",
}
"""``--help`` text of the flags that need one (the others name their config key)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the worker's flags."""
    parser.add_argument("--profile", help="YAML profile (kebab-case keys of WorkerConfig)")
    parser.add_argument("--log-level", default="INFO")
    for flag, _path, kind in FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=HELP.get(flag))


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Profile, then explicit flags, validated into a ``WorkerConfig``.

    Raises:
        ConfigError: a bad profile or value.
    """
    raw: dict[str, Any] = dict(load_profile(args.profile)) if args.profile else {}
    for flag, path, _kind in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        node = raw
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):  # absent, or null in the profile (``pool: null``)
                child = node[key] = {}
            node = child
        node[path[-1]] = value
    return build_config(raw)


def _open_publisher(config: WorkerConfig) -> KVEventPublisher | None:
    """``make_publisher`` with ZMQ's refusal worded as a config error.

    Raises:
        ConfigError: an endpoint ZMQ cannot bind or connect; the message names the flag.
    """
    try:
        return make_publisher(config)
    except EventsConfigError as exc:
        name = "--replay-endpoint" if exc.endpoint == config.replay_endpoint else "--kv-events-endpoint"
        raise ConfigError(zmq_bind_message(exc, name)) from exc


async def serve(config: WorkerConfig) -> None:
    """Run the worker until SIGINT/SIGTERM.

    Binds the HTTP port, then the KV event endpoints, then starts the engine loop and serves; on any failure
    (and on exit) everything already started is stopped, in reverse order.

    Raises:
        ListenError: the HTTP address cannot be bound (the message names it and the flag).
        ConfigError: an event endpoint cannot be bound (the message names it and the flag).
    """
    sockets = bind_tcp(config.host, config.port, port_names="--port", host_names="--host")
    publisher: KVEventPublisher | None = None
    runner: web.AppRunner | None = None
    try:
        publisher = _open_publisher(config)
        worker = build_worker(config, publisher)
        runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None)
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
        logger.info(
            "worker %s serving %s on %s",
            config.worker_id,
            config.model,
            ", ".join(f"http://{listen_address(s)}" for s in sockets),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        for sock in sockets:
            sock.close()
        if publisher is not None:
            publisher.close()


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kvgate worker``."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except (WorkerError, CommonError) as exc:
        logger.error("%s", exc)
        return 2
    return 0
