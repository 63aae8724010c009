"""``kvgate serve --config FILE``: run the gateway.

Loads the YAML (``router.config.load_config``), warns about models tokenized byte-level, builds the app
(``router.app.build_app``), binds the listen address and only then starts the app (KV event subscriptions,
workers, background tasks) and serves it with aiohttp on uvloop when available. An address that cannot be bound
(a port another process holds) or a start-up that fails stops everything already started (each resource's cleanup
context in ``router.gateway`` closes it) and exits with status 2 and one error line, as a bad config does.
``SIGINT``/``SIGTERM`` stop it cleanly: the listener closes, in-flight requests get ``listen.shutdown_grace_s`` to
finish, then each stream still relayed ends with an error event (``router.drain``), a request with no answer byte
sent yet gets ``DRAIN_END_TIMEOUT_S`` more, then its connection closes; then every background task is cancelled and
awaited (``cleanup_ctx``). A client disconnect cancels its handler (``handler_cancellation``), which closes the
upstream request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from common.errors import ListenError
from common.listen import BACKLOG, bind_tcp, listen_address, zmq_bind_message
from events.capacity import raise_open_files_limit
from events.errors import EventsConfigError
from router.app import build_app
from router.config import GatewayConfig, load_config
from router.errors import ConfigError, GatewayError
from router.gateway import DRAIN_END_TIMEOUT_S
from router.http_server import GatewayAppRunner

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.001
"""``sys.setswitchinterval`` of a gateway process (see ``serve``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvgate serve``."""
    parser.add_argument("--config", required=True, help="gateway YAML (see deploy/gateway.example.yaml)")
    parser.add_argument("--host", default=None, help="override listen.host")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING...)")
    parser.add_argument("--processes", type=int, default=1,
                        help="gateway processes on the one port (SO_REUSEPORT), each a full gateway (router.processes)")
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each of --processes


def warn_byte_level_tokenizers(config: GatewayConfig) -> None:
    """Log one warning per model without ``tokenizer_path``: its prompts are hashed as byte-level tokens.

    Byte-level tokens are the bundled sim worker's (``kvgate worker`` without ``--tokenizer``); a real engine
    tokenizes with the model's own tokenizer, so its cached blocks never match the gateway's hashes and every
    cached-token prediction is wrong.
    """
    for model in config.models:
        if model.tokenizer_path is None:
            logger.warning(
                "model %s has no tokenizer_path: prompts are tokenized byte-level, which matches only the bundled "
                "sim worker (kvgate worker); for a real engine (vLLM, SGLang) set models[].tokenizer_path (and "
                "chat_template if the engine uses a custom one) and block_size to the engine's, or cached-token "
                "predictions will not match",
                model.name,
            )


def gateway_runner(app: web.Application) -> GatewayAppRunner:
    """The runner ``serve`` serves ``app`` with: a client's disconnect cancels its handler; a graceful stop drains
    (``router.gateway.drain_on_shutdown``), then gives the handlers left ``DRAIN_END_TIMEOUT_S`` before it cancels
    them."""
    return GatewayAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=DRAIN_END_TIMEOUT_S)


async def serve(
    config: GatewayConfig, *, host: str | None = None, port: int | None = None, reuse_port: bool = False,
) -> None:
    """Run the gateway until SIGINT or SIGTERM.

    The listen address is bound before the app starts, so a taken port starts nothing; a start-up that fails
    (an ``events.bind_endpoint`` ZMQ cannot bind, a worker that cannot be added) stops what had started.

    Args:
        config: the gateway config.
        host: overrides ``listen.host``.
        port: overrides ``listen.port`` (0 picks a free one).
        reuse_port: listen with ``SO_REUSEPORT`` (one of ``--processes``).

    Raises:
        ConfigError: the address cannot be bound (the message names it and what to change), or the app refused
            its config while starting.
    """
    app = build_app(config)
    try:
        sockets = bind_tcp(
            host or config.listen.host,
            port if port is not None else config.listen.port,
            port_names="listen.port or --port",
            host_names="listen.host or --host",
            reuse_port=reuse_port,
        )
    except ListenError as exc:
        raise ConfigError(str(exc)) from exc
    runner = gateway_runner(app)
    loop = asyncio.get_running_loop()
    try:
        try:
            await runner.setup()  # a failure half-way: ``runner.cleanup`` below leaves what was entered
        except BaseException as exc:
            if isinstance(exc, EventsConfigError):  # the subscriber's bind endpoint (workers' are ConfigErrors)
                raise ConfigError(zmq_bind_message(exc, "events.bind_endpoint")) from exc
            if type(exc) is GatewayError:  # a worker whose event subscription failed otherwise (ZMQ out of sockets)
                raise ConfigError(exc.message) from exc
            raise
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
        # Everything built so far (modules, config, tokenizer tables, the app) lives as long as the process: move
        # it out of the collector's generations so full collections on the request path no longer walk it.
        gc.freeze()
        # The tokenizer threads hold the GIL while they turn a long prompt's ids into Python lists and hash its
        # blocks; the loop waits at most one switch interval for it each time (5 ms by default, the request path's
        # whole budget), so switch more often.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        logger.info("kvgate gateway listening on %s", ", ".join(f"http://{listen_address(s)}" for s in sockets))
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            logger.info("shutting down")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()
        for sock in sockets:
            sock.close()


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
    raise_open_files_limit()  # the soft limit up to the hard one: KV event rank streams take 4 descriptors each
    if args.processes < 1:
        logger.error("--processes must be >= 1, got %d", args.processes)
        return 2
    if args.processes > 1:
        from router.processes import serve_processes

        return serve_processes(args, config)
    warn_byte_level_tokenizers(config)
    try:
        _run(serve(config, host=args.host, port=args.port, reuse_port=bool(args.reuse_port)))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2
    return 0
