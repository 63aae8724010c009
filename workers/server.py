"""The worker's HTTP server (aiohttp): OpenAI API plus the endpoints the gateway uses.

Endpoints::

    POST /v1/completions, /v1/chat/completions   OpenAI, streaming (SSE) or not
    GET  /v1/models                               the served model
    POST /tokenize                                {"prompt": str | [ids]} or {"messages": [...]} -> {"tokens", "count"}
    GET  /health                                  200 while the engine loop runs
    GET  /metrics                                 Prometheus text (a registry per app)
    GET  /load                                    JSON: running/waiting requests, KV usage, free blocks per tier
                                                  (``MOONCAKE`` too where the pool store reports it; ``pool``:
                                                  its used/free blocks and the blocks this worker announced),
                                                  start id (random per process start: a change means a restart)
    GET  /kv/snapshot                             the cached blocks as one KV event batch (see below)
    POST /reset_prefix_cache                      drop every cached block (409 while requests hold blocks)
    GET  /debug/memory?limit=N                    top allocation sites (``common.process_stats.memory_report``;
                                                  start with ``PYTHONTRACEMALLOC=N`` to trace); ``group_by`` and
                                                  ``trim`` as on the gateway, a bad value a 400 naming it
    GET, POST /debug/faults                       fault injection, with ``enable-fault-injection`` only
                                                  (``workers.faults``)
    POST /kv/pull, /kv/pull/done                  the prefill side of a KV handoff (``workers.handoff``)

This module assembles the app; the routes live by concept: the OpenAI API and the generation path in
``workers.openai_routes``, the handoff halves and pull routes in ``workers.pd_routes``, health / load / snapshot /
metrics / debug in ``workers.admin_routes``, the worker's state in ``workers.worker``.

Disaggregated legs (``workers.handoff.classify_leg``): a prefill leg (vLLM ``kv_transfer_params.do_remote_decode``,
or SGLang bootstrap fields on a ``--role prefill`` worker) keeps its blocks for the decode side, and a non-streamed
vLLM prefill answer carries ``kv_transfer_params`` for the decode leg. A decode leg reserves its blocks first (503
``kv_transfer_refused`` with ``Retry-After`` when it cannot), pulls the KV, then answers like any request; a failed
pull is a 502 ``kv_transfer_failed`` (nothing was sent to the client yet).

SSE framing (as vLLM): each chunk is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. With
``stream_options.include_usage`` a last chunk with ``"choices": []`` carries ``usage``, and earlier chunks carry
``"usage": null``.

``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from any KV tier at admission, following
vLLM's rule ``block_size * min(hit_blocks, (prompt_tokens - 1) // block_size)`` (``workers.kv.sequence``).

Snapshot: the body is an ``events/encode.py`` batch (msgpack, vLLM wire shape, decodable by ``events/decode.py``)
holding ``AllBlocksCleared`` then ``BlockStored`` runs for the GPU tier, the CPU tier, then the shared pool (every
tier the worker has), parents first: lower-tier blocks also on GPU token-less, the others with parent and tokens
(``KVCacheManager.snapshot_events``). Headers:
``x-kvgate-last-seq`` is the seq of the last batch published on the live stream *before* the snapshot was taken
(-1: none yet), ``x-kvgate-start-id`` the worker's start id. A subscriber splices: apply the snapshot, then apply
live batches with ``seq > last_seq`` (drop those ``<= last_seq``; replay ``last_seq + 1 ..`` if it missed any).

Errors are OpenAI JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input, 404 for an
unknown model. A client that disconnects cancels its handler (``handler_cancellation``) and the request's
blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from common.errors import InvalidRequestError
from workers.admin_routes import (
    debug_memory,
    get_faults,
    health,
    load,
    load_info,
    metrics,
    reset_prefix_cache,
    set_faults,
    snapshot,
)
from workers.openai_routes import chat_completions, completions, models, tokenize
from workers.pd_routes import kv_pull, kv_pull_done
from workers.worker import (
    ENGINE_TTFT_KEY,
    LOOP_KEY,
    WORKER_ID_HEADER,
    WORKER_KEY,
    Worker,
    build_worker,
    error_response,
    make_publisher,
)

__all__ = ["ENGINE_TTFT_KEY", "WORKER_ID_HEADER", "Worker", "build_app", "build_worker", "load_info", "make_publisher"]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn ``InvalidRequestError`` into OpenAI error JSON (400)."""
    worker = request.app[WORKER_KEY]
    try:
        return await handler(request)
    except InvalidRequestError as exc:
        return error_response(worker, 400, exc.message, exc.param, exc.code)


async def _engine_loop_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[WORKER_KEY].core.run(), name="engine-loop")
    app[LOOP_KEY] = task
    yield
    worker = app[WORKER_KEY]
    worker.prefill_handoff.release_all()
    await worker.decode_handoff.close()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    worker.core.kv.close()


async def _stop_receiving(app: web.Application) -> None:
    """Shutdown begins (before the grace period for the handlers): decode legs waiting for blocks are refused."""
    app[WORKER_KEY].core.stop_receiving()


def build_app(worker: Worker) -> web.Application:
    """The aiohttp app of ``worker``; the engine loop starts and stops with the app."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[WORKER_KEY] = worker
    app.cleanup_ctx.append(_engine_loop_ctx)
    app.on_shutdown.append(_stop_receiving)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/load", load)
    app.router.add_get("/kv/snapshot", snapshot)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/debug/memory", debug_memory)
    if worker.config.enable_fault_injection:
        app.router.add_get("/debug/faults", get_faults)
        app.router.add_post("/debug/faults", set_faults)
    app.router.add_post("/kv/pull", kv_pull)
    app.router.add_post("/kv/pull/done", kv_pull_done)
    return app
