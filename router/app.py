"""The gateway application: ``build_app(config) -> web.Application``.

The components are built and wired by ``router.gateway.Gateway`` (the composition root) and stored under
``router.gateway.GATEWAY``; each resource starts and stops in its own cleanup context (``router.gateway``), so a
start-up that fails half-way unwinds what it had started.

Routes::

    POST /v1/completions, /v1/chat/completions    routed and proxied (streaming passthrough)   router.api
    GET  /v1/models                                the fleet's models                           router.api
    GET  /health                                   alive (200 always)                           router.api
    GET  /ready                                    200 when every worker's index is warm (or    router.api
                                                   the ready timeout passed; also with zero
                                                   workers), else 503
    GET  /metrics                                  Prometheus text format                       router.api
    GET  /openapi.json                             this API as an OpenAPI 3.1 document          router.openapi
    *    /admin/...                                the admin API                                router.admin

Request path (``router.api``, one handler, no middleware): read the body (limit) -> ``parse_request``
(msgspec, routing fields only) -> the model's ``ModelTokenizer.view`` (incremental) -> admission ->
``RequestFlight.run`` (``router.lifecycle``: route, forward, finish). Every error is an OpenAI-style JSON body
(``router.errors`` gives the status). Event path: ``router.event_path``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from router.admin import add_admin_routes
from router.api import _add_json_fallbacks, chat_completions, completions, health, metrics, models, ready
from router.config import GatewayConfig
from router.gateway import CLEANUP_CONTEXTS, GATEWAY, Gateway, drain_on_shutdown
from router.openapi import add_openapi_route
from router.transport import Transport

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["build_app"]


def build_app(
    config: GatewayConfig, *, transport: Transport | None = None, clock: Callable[[], float] = time.monotonic,
    span_exporter: SpanExporter | None = None,
) -> web.Application:
    """Build the gateway application (nothing starts until the app runs).

    Args:
        config: the decoded configuration.
        transport: the upstream transport (default ``AiohttpTransport``; tests pass a ``MockTransport``).
        clock: monotonic clock in seconds (injected in tests: session expiry, breakers, readiness).
        span_exporter: replaces the OTLP exporter when ``tracing.enabled`` (tests: the SDK's in-memory one).

    Raises:
        ConfigError: a section that does not validate, a tokenizer that does not load, or no admin token.
    """
    admin_token = config.admin.resolve_token()
    app = web.Application(client_max_size=config.listen.max_body_bytes)
    app[GATEWAY] = Gateway(config, transport=transport, clock=clock, span_exporter=span_exporter)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app, admin_token)
    add_openapi_route(app)
    _add_json_fallbacks(app)
    app.on_shutdown.append(drain_on_shutdown)  # before aiohttp's wait for the handlers and the contexts' exits
    app.cleanup_ctx.extend(CLEANUP_CONTEXTS)
    if config.endpoint_picker is not None:  # grpcio (the epp extra) only when the endpoint picker runs
        from router.epp import epp_context

        app.cleanup_ctx.append(epp_context)
    return app
