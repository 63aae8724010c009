"""The gateway's API as an OpenAPI 3.1 document, served at ``GET /openapi.json``.

``openapi_document()`` describes every route ``router.app.build_app`` registers: the OpenAI routes
(``router.api``), the probes, ``/metrics`` and the admin API (``router.admin``). ``OPERATIONS`` is the route table
the document is built from; ``tests/router/test_openapi.py`` checks that it equals the app's routes, both ways.

Schemas come from the gateway's own msgspec structs where they exist (``msgspec.json.schema_components``): a
worker entry (``WorkerConfig``), a policy (``PolicyConfig``, a tagged union on ``name``), a session
(``SessionInfo``), index stats (``IndexStats``), a worker's load (``WorkerLoad``), and the routing fields of the
OpenAI request bodies (``router.request_view``). The checks those bodies get after decoding (``max_tokens >= 1``,
``n == 1``, a non-empty prompt or messages, text-only content parts) are added to the generated schemas by
``_refine``, so the document refuses what the gateway refuses. Answers assembled from plain dicts (a worker's
``info``, decisions, the memory report) are written out here.

Every error is the OpenAI error object (``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``,
``router.api.error_response``). The admin routes take ``Authorization: Bearer <token>`` (the ``adminToken``
scheme); the others are open. A request body the OpenAI routes do not route on (``temperature``, ``tools``...)
is forwarded to the worker as sent, so their bodies allow other properties.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from policies.config import PolicyConfig
from router.fleet import WorkerLoad
from router.index.result import IndexStats
from router.request_view import _ChatBody, _CompletionBody
from router.sessions.base import SessionInfo
from router.worker_config import WorkerConfig

__all__ = ["OPENAPI_PATH", "OPERATIONS", "Operation", "add_openapi_route", "app_routes", "openapi_document"]

OPENAPI_PATH = "/openapi.json"

_REF = "#/components/schemas/{name}"
_RENAMED = {"_ChatBody": "ChatCompletionRequest", "_CompletionBody": "CompletionRequest",
            "_Message": "ChatMessage", "_TextPart": "ChatContentPart"}
"""Generated component names -> public ones (the request structs are private to ``router.request_view``)."""

MAX_TOKEN_ID = 2**32 - 1
"""Token ids are hashed as little-endian uint32 (``router.block_hash``)."""


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(name=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _rename_refs(obj: Any) -> Any:
    if isinstance(obj, dict):
        out = {k: _rename_refs(v) for k, v in obj.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[-1]
            out["$ref"] = _REF.format(name=_RENAMED.get(name, name))
        return out
    if isinstance(obj, list):
        return [_rename_refs(v) for v in obj]
    return obj


def _refine(schemas: dict[str, Any]) -> None:
    """Add the checks ``router.request_view`` makes after decoding to the generated request schemas."""
    positive_or_null = _nullable({"type": "integer", "minimum": 1})
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["max_tokens"] = {**positive_or_null, "default": None}
        props["n"] = {**_nullable({"const": 1}), "default": None, "description": "only n=1 is supported"}
        schemas[name]["additionalProperties"] = True  # forwarded to the worker as sent
    chat = schemas["ChatCompletionRequest"]["properties"]
    chat["max_completion_tokens"] = {**positive_or_null, "default": None}
    chat["messages"]["minItems"] = 1
    schemas["ChatMessage"]["properties"]["role"]["minLength"] = 1
    schemas["ChatContentPart"] = {
        "title": "ChatContentPart", "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "description": "Only text parts are routed; other kinds are refused with 400."}
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}
    text = {"type": "string", "minLength": 1}
    schemas["CompletionRequest"]["properties"]["prompt"] = {
        "description": "A string, an array of token ids, or an array holding one of those (one prompt a request).",
        "anyOf": [text, token_ids,
                  {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
                  {"type": "array", "minItems": 1, "maxItems": 1, "items": token_ids}]}


def _struct_schemas() -> dict[str, Any]:
    types = [_ChatBody, _CompletionBody, WorkerConfig, PolicyConfig, SessionInfo, IndexStats, WorkerLoad]
    tops, components = msgspec.json.schema_components(types, ref_template=_REF)
    schemas = {_RENAMED.get(name, name): _rename_refs(schema) for name, schema in components.items()}
    schemas["PolicyConfig"] = {"title": "PolicyConfig", "description": "A policy, tagged by ``name``.",
                               **tops[types.index(PolicyConfig)]}
    for name in _RENAMED.values():
        schemas[name]["title"] = name
    _refine(schemas)
    return schemas


_OBJECT = {"type": "object"}
_STR_MAP_INT = {"type": "object", "additionalProperties": {"type": "integer"}}

_HAND_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": {
        "type": "object", "required": ["error"], "description": "The OpenAI error object.",
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    "Completion": {
        "type": "object", "required": ["choices"],
        "description": "The worker's answer, relayed as it sent it (OpenAI ``text_completion`` / "
                       "``chat.completion``).",
        "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                       "model": {"type": "string"}, "choices": {"type": "array", "items": _OBJECT},
                       "usage": _OBJECT}},
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}}}}}},
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
    "Ready": {"type": "object", "required": ["ready", "waiting_for"],
              "properties": {"ready": {"type": "boolean"},
                             "waiting_for": {"type": "array", "items": {"type": "string"}}}},
    "WorkerInfo": {
        "type": "object", "description": "A worker with its health, load, circuit and warm state.",
        "required": ["id", "url", "model", "is_healthy", "is_draining", "is_warm", "circuit"],
        "properties": {
            "id": {"type": "string"}, "url": {"type": "string"}, "model": {"type": "string"},
            "events_endpoint": {"type": ["string", "null"]}, "topology": {"enum": ["connect", "bind"]},
            "pools": {"type": "array", "items": {"type": "string"}}, "block_size": {"type": "integer"},
            "is_healthy": {"type": "boolean"}, "is_draining": {"type": "boolean"}, "is_warm": {"type": "boolean"},
            "is_approximate": {"type": "boolean"}, "circuit": {"enum": ["closed", "open", "half_open"]},
            "num_inflight_requests": {"type": "integer"}, "num_inflight_prompt_tokens": {"type": "integer"},
            "num_pending_prefill_tokens": {"type": "integer"},
            "num_pending_prefill_token_pairs": {"type": "integer"}, "num_decoding_requests": {"type": "integer"},
            "load": _nullable(_ref("WorkerLoad")), "start_id": {"type": ["string", "integer", "null"]}}},
    "WorkerList": {"type": "object", "required": ["workers"],
                   "properties": {"workers": {"type": "array", "items": _ref("WorkerInfo")}}},
    "WorkerRemoved": {"type": "object", "required": ["removed"], "properties": {"removed": {"type": "string"}}},
    "SessionList": {"type": "object", "required": ["num_sessions", "sessions"],
                    "properties": {"num_sessions": {"type": "integer", "minimum": 0},
                                   "sessions": {"type": "array", "items": _ref("SessionInfo")}}},
    "SessionsDropped": {"type": "object", "required": ["num_dropped"],
                        "properties": {"num_dropped": {"type": "integer", "minimum": 0}}},
    "SessionDropped": {"type": "object", "required": ["dropped"], "properties": {"dropped": {"type": "string"}}},
    "IndexStatsByModel": {"type": "object", "additionalProperties": _ref("IndexStats"),
                          "description": "Model name -> its index's stats."},
    "IndexClearRequest": {
        "type": "object", "additionalProperties": False,
        "description": "Empty (or no body) clears every worker's entries; ``worker_id`` one worker's.",
        "properties": {"worker_id": {"type": "string", "minLength": 1}}},
    "IndexCleared": {"type": "object", "required": ["cleared"],
                     "properties": {"cleared": {"type": "array", "items": {"type": "string"}}}},
    "PolicyAnswer": {"type": "object", "required": ["policy"],
                     "properties": {"policy": _ref("PolicyConfig"),
                                    "speed_factors": {"type": "object", "additionalProperties": {"type": "number"}}}},
    "PolicyRequest": {"description": "A policy, or ``GET /admin/policy``'s answer (the policy under ``policy``).",
                      "anyOf": [_ref("PolicyConfig"),
                                {"type": "object", "required": ["policy"], "properties": {
                                    "policy": _ref("PolicyConfig")}}]},
    "DecisionList": {"type": "object", "required": ["decisions"], "properties": {"decisions": {
        "type": "array", "items": {
            "type": "object", "required": ["request_id", "model", "num_prompt_tokens", "decision_s", "at_s", "age_s"],
            "description": "A ``router.decisions.DecisionRecord`` (with ``cost_terms``) or a ``PDRecord`` "
                           "(``kind: pd``), without its inputs; ``age_s`` is seconds since the decision.",
            "properties": {"request_id": {"type": "string"}, "model": {"type": "string"},
                           "num_prompt_tokens": {"type": "integer"}, "decision_s": {"type": "number"},
                           "at_s": {"type": "number"}, "age_s": {"type": "number", "minimum": 0},
                           "scores": {"type": "object", "additionalProperties": {"type": "number"}},
                           "cached_tokens": _STR_MAP_INT, "cost_terms": _OBJECT,
                           "answer": {"type": ["object", "null"], "properties": {
                               "served_by": {"type": ["string", "null"]},
                               "reported_cached_tokens": {"type": ["integer", "null"]},
                               "outcome": {"type": "string"}}}}}}}},
    "MemoryReport": {
        "type": "object", "required": ["is_tracing", "traced_bytes", "peak_traced_bytes", "num_gc_objects", "sites"],
        "properties": {"is_tracing": {"type": "boolean"}, "traced_bytes": {"type": "integer"},
                       "peak_traced_bytes": {"type": "integer"}, "num_gc_objects": {"type": "integer"},
                       "num_collected": {"type": ["integer", "null"]},
                       "malloc": {"type": ["object", "null"], "properties": {k: {"type": "integer"} for k in (
                           "arena_bytes", "mmap_bytes", "in_use_bytes", "free_bytes", "releasable_bytes")}},
                       "allocator": {"type": "string", "enum": ["glibc", "jemalloc", "other"]},
                       "jemalloc": {"type": ["object", "null"], "properties": {
                           f"{k}_bytes": {"type": "integer"} for k in (
                               "allocated", "active", "resident", "mapped", "retained")}},
                       "jemalloc_bins": {"type": ["array", "null"], "items": {"type": "object", "properties": {
                           k: {"type": "integer"} for k in (
                               "region_bytes", "num_regions", "num_slabs", "slab_bytes", "idle_bytes")}}},
                       "trimmed": {"type": "boolean"},
                       "sites": {"type": "array", "items": {
                           "type": "object", "required": ["file", "line", "size_bytes", "num_blocks"],
                           "properties": {"file": {"type": "string"}, "line": {"type": "integer"},
                                          "size_bytes": {"type": "integer"}, "num_blocks": {"type": "integer"},
                                          "stack": {"type": "array", "items": {"type": "string"}}}}}}},
}

_ERROR_TEXT = {400: "invalid request (``invalid_request_error``)", 401: "missing or wrong admin bearer token",
               404: "unknown model, worker, session or route", 408: "the body did not arrive in time",
               413: "body over ``listen.max_body_bytes``", 429: "admission queue full (``Retry-After``)",
               502: "every attempt at a worker failed before its answer started",
               503: "no healthy worker can take the request (``Retry-After``)",
               504: "a worker's connect or first-byte timeout"}


class Operation(msgspec.Struct, frozen=True):
    """One route of the gateway as the document describes it.

    Attributes:
        method: HTTP method (upper case).
        path: aiohttp's path template (``/admin/workers/{worker_id}``: the same syntax as OpenAPI's).
        summary: one line.
        ok: the success status.
        answer: the success body's schema name (``None``: no JSON body); ``text/plain`` for ``Metrics``.
        body: the request body's schema name, or ``None``.
        errors: the documented error statuses (each an ``ErrorResponse``).
        is_admin: guarded by the admin bearer token.
        query: query parameters: name -> schema.
    """

    method: str
    path: str
    summary: str
    ok: int = 200
    answer: str | None = None
    body: str | None = None
    errors: tuple[int, ...] = ()
    is_admin: bool = False
    query: dict[str, dict[str, Any]] = {}


_LIMIT = {"type": "integer", "description": "clamped to 1..10,000 (default 100)"}
_SECONDS = {"type": "number", "minimum": 0}
_SESSION_FILTERS: dict[str, dict[str, Any]] = {
    "worker_id": {"type": "string", "minLength": 1}, "key_prefix": {"type": "string"},
    "min_idle_s": _SECONDS, "max_idle_s": _SECONDS, "min_age_s": _SECONDS}
"""``/admin/sessions`` filters (``router.sessions.base.SessionFilter``), on the listing and the bulk drop."""
_MEMORY_QUERY: dict[str, dict[str, Any]] = {
    "limit": {"type": "integer", "description": "sites, clamped to 0..1,000 (default 25)"},
    "group_by": {"type": "string", "enum": ["lineno", "traceback"]},
    "trim": {"type": "boolean", "description": "return glibc's free heap pages first (malloc_trim)"},
    "collect": {"type": "boolean", "description": "a full garbage collection first (gc.collect)"},
}
_ROUTED_ERRORS = (400, 404, 408, 413, 429, 502, 503, 504)

OPERATIONS: tuple[Operation, ...] = (
    Operation("POST", "/v1/chat/completions", "Route and proxy a chat completion (streamed when ``stream``).",
              answer="Completion", body="ChatCompletionRequest", errors=_ROUTED_ERRORS),
    Operation("POST", "/v1/completions", "Route and proxy a text completion (streamed when ``stream``).",
              answer="Completion", body="CompletionRequest", errors=_ROUTED_ERRORS),
    Operation("GET", "/v1/models", "Every model served by at least one worker.", answer="ModelList"),
    Operation("GET", "/health", "The process is alive.", answer="Health"),
    Operation("GET", "/ready", "200 once every worker's index is warm (or the ready timeout passed), else 503.",
              answer="Ready"),
    Operation("GET", "/metrics", "Prometheus text exposition.", answer="Metrics"),
    Operation("GET", OPENAPI_PATH, "This document.", answer="OpenAPI"),
    Operation("GET", "/admin/workers", "List workers.", answer="WorkerList", is_admin=True),
    Operation("POST", "/admin/workers", "Add a worker (one health check first).", ok=201, answer="WorkerInfo",
              body="WorkerConfig", errors=(400,), is_admin=True),
    Operation("DELETE", "/admin/workers/{worker_id}", "Remove a worker: its index entries and sessions go at once.",
              answer="WorkerRemoved", errors=(404,), is_admin=True),
    Operation("POST", "/admin/workers/{worker_id}/drain", "No new requests to the worker.", answer="WorkerInfo",
              errors=(404,), is_admin=True),
    Operation("POST", "/admin/workers/{worker_id}/undrain", "Route to the worker again.", answer="WorkerInfo",
              errors=(404,), is_admin=True),
    Operation("GET", "/admin/sessions", "Live sessions, most recently used first.", answer="SessionList",
              errors=(400,), is_admin=True, query={"limit": _LIMIT, **_SESSION_FILTERS}),
    Operation("DELETE", "/admin/sessions", "Forget every session the filter takes (``all=true``: every session).",
              answer="SessionsDropped", errors=(400,), is_admin=True,
              query={"all": {"enum": ["true", "false"]}, **_SESSION_FILTERS}),
    Operation("DELETE", "/admin/sessions/{key}", "Forget one session.", answer="SessionDropped", errors=(404,),
              is_admin=True),
    Operation("GET", "/admin/index", "Index stats per model.", answer="IndexStatsByModel", is_admin=True),
    Operation("POST", "/admin/index/clear", "Clear index entries, then re-warm them from the workers.",
              answer="IndexCleared", body="IndexClearRequest", errors=(400, 404), is_admin=True),
    Operation("GET", "/admin/policy", "The policy config and the learned speed factors.", answer="PolicyAnswer",
              is_admin=True),
    Operation("PUT", "/admin/policy", "Replace the policy (validated first; the old one stays on error).",
              answer="PolicyAnswer", body="PolicyRequest", errors=(400,), is_admin=True),
    Operation("GET", "/admin/decisions", "Recent decisions with every candidate's score and cost terms.",
              answer="DecisionList", errors=(400,), is_admin=True, query={"limit": _LIMIT}),
    Operation("GET", "/admin/debug/memory", "Top allocation sites of a tracemalloc snapshot and the C heap's state.",
              answer="MemoryReport", errors=(400,), is_admin=True, query=_MEMORY_QUERY),
)
"""Every route of the gateway (``build_app``), in registration order."""


def _answer_content(name: str) -> dict[str, Any]:
    if name == "Metrics":
        return {"text/plain": {"schema": {"type": "string"}}}
    if name == "OpenAPI":
        return {"application/json": {"schema": {"type": "object", "required": ["openapi", "paths"]}}}
    content: dict[str, Any] = {"application/json": {"schema": _ref(name)}}
    if name == "Completion":
        content["text/event-stream"] = {"schema": {  # one server-sent event: ``data: {...}``, last ``data: [DONE]``
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}
    return content


def _operation(op: Operation) -> dict[str, Any]:
    error = {"application/json": {"schema": _ref("ErrorResponse")}}
    responses: dict[str, Any] = {str(op.ok): {"description": op.summary, "content": _answer_content(op.answer)}
                                 if op.answer is not None else {"description": op.summary}}
    if op.path == "/ready":
        responses["503"] = {"description": "not ready yet", "content": _answer_content("Ready")}
    statuses = sorted({*op.errors, *((401,) if op.is_admin else ())})
    for status in statuses:
        responses[str(status)] = {"description": _ERROR_TEXT[status], "content": error}
    out: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op), "responses": responses}
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
              for name in _path_params(op.path)]
    params += [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in op.query.items()]
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": op.body not in ("IndexClearRequest",),
                              "content": {"application/json": {"schema": _ref(op.body)}}}
    out["security"] = [{"adminToken": []}] if op.is_admin else []
    return out


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


def _operation_id(op: Operation) -> str:
    words = [p.strip("{}").replace(".", "_").replace("-", "_") for p in op.path.split("/") if p]
    return "_".join([op.method.lower(), *words])


def openapi_document(*, title: str = "kvgate gateway", version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``OPERATIONS`` (JSON builtins: dicts, lists, strings, numbers)."""
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    document = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible routes of a cache-aware LLM router, and its admin API."},
        "paths": paths,
        "components": {
            "schemas": {**_struct_schemas(), **_HAND_SCHEMAS},
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "``admin.token`` (or ``admin.token_env``)."}},
        },
    }
    out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(document))  # defaults given as tuples: lists
    return out


def app_routes(app: web.Application) -> set[tuple[str, str]]:
    """(method, path template) of every route registered on ``app`` so far, without HEAD (aiohttp adds one to each
    GET) and without ``*`` routes (``router.api._add_json_fallbacks``)."""
    routes = set()
    for resource in app.router.resources():
        info = resource.get_info()
        path = info.get("path") or info.get("formatter")
        for route in resource:
            if route.method not in ("HEAD", "*") and isinstance(path, str):
                routes.add((route.method, path))
    return routes


def add_openapi_route(app: web.Application) -> None:
    """Register ``GET /openapi.json`` (the document is built once, here)."""
    body = msgspec.json.encode(openapi_document())

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get(OPENAPI_PATH, openapi)
