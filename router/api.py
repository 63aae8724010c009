"""The OpenAI routes and the probes: the request handlers that ``router.app.build_app`` registers.

Routes::

    POST /v1/completions, /v1/chat/completions    routed and proxied (streaming passthrough)
    GET  /v1/models                                the fleet's models
    GET  /health                                   alive (200 always)
    GET  /ready                                    200 when every worker's index is warm (or the ready timeout
                                                   passed; also with zero workers), else 503
    GET  /metrics                                  Prometheus text format

Every error is an OpenAI-style JSON body (``router.errors`` gives the status); ``_add_json_fallbacks`` answers
unknown paths and methods the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor

import msgspec
from aiohttp import web

from router.errors import (
    BodyTimeoutError,
    BodyTooLargeError,
    GatewayError,
    InvalidFieldError,
    MethodNotAllowedError,
    NotFoundError,
    NoWorkerError,
    OverloadedError,
    UnknownModelError,
    unreadable_body_error,
)
from router.fleet import WorkerRuntime
from router.gateway import GATEWAY
from router.proxy import REQUEST_ID_HEADER
from router.request_view import ModelTokenizer, ParsedRequest, PromptView, RequestKind, parse_request

logger = logging.getLogger(__name__)


def error_response(exc: GatewayError, request_id: str | None = None) -> web.Response:
    """The OpenAI-style JSON error for ``exc`` with its status (plus ``Retry-After`` for 429 and 503, and
    ``x-request-id`` when the error answers a request that has an id)."""
    body = msgspec.json.encode({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                                          "code": exc.code}})
    headers = {}
    if isinstance(exc, OverloadedError | NoWorkerError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return web.Response(status=exc.status, body=body, content_type="application/json", headers=headers)


def _add_json_fallbacks(app: web.Application) -> None:
    """OpenAI-style JSON errors instead of aiohttp's plain-text ones: 405 (with ``Allow``) for a known path called
    with another method, 404 for any other path. Added after every route, so a matching route always wins."""
    for resource in list(app.router.resources()):
        if not isinstance(resource, web.Resource):
            continue
        allowed = sorted({route.method for route in resource})

        async def not_allowed(request: web.Request, allowed: list[str] = allowed) -> web.StreamResponse:
            response = error_response(MethodNotAllowedError(
                f"{request.method} is not allowed on {request.path}; allowed: {', '.join(allowed)}"))
            response.headers["Allow"] = ", ".join(allowed)
            return response

        resource.add_route("*", not_allowed)

    async def not_found(request: web.Request) -> web.StreamResponse:
        return error_response(NotFoundError(f"no route {request.method} {request.path}"))

    app.router.add_route("*", "/{path:.*}", not_found)


OFF_LOOP_BODY_BYTES = 1 << 16
"""A request body larger than this (bytes; about a 16K-token prompt) is decoded in a thread
(``parse_request_async``). msgspec holds the GIL through the whole decode (a few ms per MB; 0.65 ms for the 425 KB
of a 100K-token conversation), so the loop still waits for the decode itself, but no longer for the plan that ran
after it in the same step (``router.request_view.OFF_LOOP_PLAN_CHARS``), and many long bodies arriving together
are no longer decoded back to back in one step of the loop (``python -m benchmarks long_turns``: the loop's
worst lag with 100K-token conversations 22 -> 16 ms at concurrency 8, 78 -> 56 ms at 32, 16-core host). The
decodes run in the gateway's one parse thread (``router.request_view.PARSE_THREADS``), not the default executor's
(its ``min(32, cores + 4)`` threads would only queue for the GIL, the loop among them)."""


OFF_LOOP_PLAN_CHARS = 1 << 20
"""A prompt with more text than this (characters) is planned in a tokenizer thread (``ModelTokenizer.view_async``'s
``plan_off_loop``): the cache lookups hash and cut the whole text (15 MB: 40-80 ms of Python, which a thread shares
with the loop every switch interval)."""


def num_prompt_chars(parsed: ParsedRequest) -> int:
    """Characters of ``parsed``'s prompt text (every chat message's content; 0 for token ids)."""
    if parsed.kind == "chat":
        return sum(len(m.content) for m in parsed.messages)
    return len(parsed.prompt) if isinstance(parsed.prompt, str) else 0


async def prompt_view(tokenizer: ModelTokenizer, parsed: ParsedRequest) -> PromptView:
    """``parsed``'s view as the gateway makes it: ``tokenizer.view_async``, planned in a tokenizer thread for a
    prompt over ``OFF_LOOP_PLAN_CHARS`` characters (``num_prompt_chars``).

    Raises:
        InvalidFieldError: as ``ModelTokenizer.view``.
    """
    return await tokenizer.view_async(parsed, plan_off_loop=num_prompt_chars(parsed) > OFF_LOOP_PLAN_CHARS)


async def parse_request_async(kind: RequestKind, body: bytes, executor: Executor) -> ParsedRequest:
    """``parse_request``, in ``executor`` (the gateway's ``parse_executor``: ``PARSE_THREADS`` threads) for a body
    over ``OFF_LOOP_BODY_BYTES``.

    Raises:
        InvalidJSONError, InvalidFieldError: as ``parse_request``.
    """
    if len(body) <= OFF_LOOP_BODY_BYTES:
        return parse_request(kind, body)
    return await asyncio.get_running_loop().run_in_executor(executor, parse_request, kind, body)


async def _handle(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    """The routed endpoints (``completions``, ``chat_completions``): read the body (limit), ``parse_request``
    (msgspec, routing fields only; a long body in a worker thread, ``parse_request_async``), the model's
    ``ModelTokenizer.view`` (incremental), an admission slot; then the request's ``RequestFlight``
    (``router.lifecycle``) routes, forwards and settles it."""
    gw = request.app[GATEWAY]
    t0 = time.perf_counter()
    client_headers = gw.client_headers.read(request.raw_headers, request.headers)
    request_id = client_headers.request_id or gw.next_request_id()  # the client's own id is kept end to end
    tracer = gw.tracer  # None unless tracing.enabled (router.tracing): then no span object is made
    trace = tracer.begin(t0, request.headers) if tracer is not None else None
    try:
        limit = gw.config.listen.max_body_bytes
        num_body_bytes = request.content_length
        if num_body_bytes is not None and num_body_bytes > limit:
            raise BodyTooLargeError(f"request body of {num_body_bytes} bytes exceeds the {limit}-byte limit")
        try:
            if request.content.is_eof():  # the whole body came with the headers (most requests): no timer
                body = await request.read()
            else:
                async with asyncio.timeout(gw.config.listen.body_timeout_s):
                    body = await request.read()
        except TimeoutError as exc:
            raise BodyTimeoutError(
                f"the request body did not arrive within {gw.config.listen.body_timeout_s} s") from exc
        except web.HTTPRequestEntityTooLarge as exc:
            raise BodyTooLargeError(f"request body exceeds the {limit}-byte limit") from exc
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding the body does not decode with
            raise unreadable_body_error(exc) from exc
        parsed = await parse_request_async(kind, body, gw.parse_executor)
        if trace is not None:
            trace.parsed()
        model = gw.config.model(parsed.model)
        if model is None:
            raise UnknownModelError(f"the model {parsed.model!r} does not exist", param="model",
                                    code="model_not_found")
        view = await prompt_view(gw.tokenizers[model.name], parsed)
        if trace is not None:
            trace.tokenized()
        if view.num_tokens == 0:
            raise InvalidFieldError("the prompt has no tokens", param="prompt")
        per_worker = gw.config.admission.max_inflight_per_worker
        if not gw.admission.try_acquire():
            # Candidates are read at every check: a worker added while the request waits gives it room.
            fleet, model_name = gw.fleet, model.name
            await gw.admission.acquire(lambda: _may_proceed(fleet.candidates(model_name), per_worker))
    except GatewayError as exc:
        gw.metrics.rejected_total.labels(type(exc).__name__).inc()
        if trace is not None:
            trace.request_id = request_id
            trace.fail(exc)
        return _answer_error(exc, request_id)
    # From here the flight holds the admission slot and settles the request, whatever happens (router.lifecycle).
    if model.pd is not None:  # disaggregated: a prefill leg and a decode leg (router.pd; not traced)
        outcome = await gw.pd.start(request_id).run(request, body, parsed, model, view, client_headers,
                                                    received_at=t0)
    else:
        flight = gw.lifecycle.start(request_id) if trace is None else trace.start_flight(gw.lifecycle, request_id)
        outcome = await flight.run(request, body, parsed, model, view, client_headers, received_at=t0)
    if outcome.response is None:
        error = outcome.error if outcome.error is not None else GatewayError("the request got no answer")
        gw.metrics.rejected_total.labels(type(error).__name__).inc()
        return _answer_error(error, request_id)
    return outcome.response


def _answer_error(exc: GatewayError, request_id: str) -> web.Response:
    """``error_response``; an error of the gateway's own with a 5xx status (no worker, every attempt failed) is
    logged once, at WARNING, with the request id (a client's error and a worker's relayed answer are not)."""
    if exc.status >= 500:
        logger.warning("request %s answered %d (%s): %s", request_id, exc.status, type(exc).__name__, exc.message)
    return error_response(exc, request_id)


def _may_proceed(candidates: Sequence[WorkerRuntime], max_inflight_per_worker: int) -> bool:
    """Admission's per-worker check: a usable (healthy, undrained) candidate has room, or none is usable at all:
    then there is nothing to wait for, and routing answers 503 with the reason at once."""
    if max_inflight_per_worker == 0:
        return True
    usable = [w for w in candidates if w.is_healthy and not w.is_draining]
    return not usable or any(w.num_inflight_requests < max_inflight_per_worker for w in usable)


completions = functools.partial(_handle, kind="completions")
"""``POST /v1/completions``."""
chat_completions = functools.partial(_handle, kind="chat")
"""``POST /v1/chat/completions``."""


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: every model served by at least one worker."""
    gw = request.app[GATEWAY]
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvgate"} for name in gw.fleet.model_names()]
    return web.Response(body=msgspec.json.encode({"object": "list", "data": data}), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the process is alive."""
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: 200 once every worker's index is warm (or the ready timeout passed)."""
    gw = request.app[GATEWAY]
    is_ready = gw.fleet.is_ready()
    waiting = [w.worker_id for w in gw.fleet.workers.values() if not w.is_warm]
    body = msgspec.json.encode({"ready": is_ready, "waiting_for": waiting})
    return web.Response(status=200 if is_ready else 503, body=body, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    gw = request.app[GATEWAY]
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})
