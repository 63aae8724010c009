"""``kvgate serve --config FILE``: run the gateway.

Loads the YAML (``router.config.load_config``), builds the app (``router.app.build_app``) and serves it with
aiohttp on uvloop when available. ``SIGINT``/``SIGTERM`` stop it cleanly: the listener closes, in-flight
requests get ``shutdown_timeout_s`` to finish, then every background task is cancelled and awaited
(``cleanup_ctx``). A client disconnect cancels its handler (``handler_cancellation``), which closes the upstream
request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from router.app import build_app
from router.config import GatewayConfig, load_config
from router.errors import ConfigError

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvgate serve``."""
    parser.add_argument("--config", required=True, help="gateway YAML (see deploy/gateway.example.yaml)")
    parser.add_argument("--host", default=None, help="override listen.host")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING...)")


async def serve(config: GatewayConfig, *, host: str | None = None, port: int | None = None) -> None:
    """Run the gateway until SIGINT or SIGTERM."""
    app = build_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, host or config.listen.host, port if port is not None else config.listen.port,
                       backlog=1024)
    await site.start()
    # Everything built so far (modules, config, tokenizer tables, the app) lives as long as the process: move it
    # out of the collector's generations so full collections on the request path no longer walk it.
    gc.freeze()
    logger.info("kvgate gateway listening on %s", site.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("shutting down")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` on uvloop when it is installed, else on the default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kvgate serve``; returns the exit status (2 for a bad config)."""
    logging.basicConfig(level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2
    try:
        _run(serve(config, host=args.host, port=args.port))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2
    return 0
