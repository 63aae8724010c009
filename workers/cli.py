"""``kvgate worker``: run a reference worker.

Flags override the YAML profile (``--profile``), which overrides the defaults of ``workers.config``. The shared
pool tier (``kv-cache.pool``) is enabled by any ``--pool-*`` / ``--mooncake-*`` flag, e.g.
``--pool-backend mooncake --mooncake-master 127.0.0.1:50051`` or ``--pool-backend sim --pool-name fleet-a``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web

from workers.config import WorkerConfig, build_config, load_profile
from workers.errors import WorkerError
from workers.server import build_app, build_worker, make_publisher

logger = logging.getLogger(__name__)

# (flag, config path, type)
FLAGS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("--worker-id", ("worker-id",), str),
    ("--model", ("model",), str),
    ("--host", ("host",), str),
    ("--port", ("port",), int),
    ("--engine", ("engine",), str),
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
    ("--max-num-seqs", ("scheduler", "max-num-seqs"), int),
    ("--max-num-batched-tokens", ("scheduler", "max-num-batched-tokens"), int),
    ("--max-model-len", ("scheduler", "max-model-len"), int),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the worker's flags."""
    parser.add_argument("--profile", help="YAML profile (kebab-case keys of WorkerConfig)")
    parser.add_argument("--log-level", default="INFO")
    for flag, _path, kind in FLAGS:
        parser.add_argument(flag, type=kind, default=None)


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


async def serve(config: WorkerConfig) -> None:
    """Run the worker until SIGINT/SIGTERM."""
    publisher = make_publisher(config)
    try:
        worker = build_worker(config, publisher)
        runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        logger.info("worker %s serving %s on %s:%d", config.worker_id, config.model, config.host, config.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
    finally:
        if publisher is not None:
            publisher.close()


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kvgate worker``."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except WorkerError as exc:
        logger.error("%s", exc)
        return 2
    return 0
