"""Admin REST API under ``/admin``, guarded by a bearer token (``Authorization: Bearer <token>``).

Routes (JSON in and out; errors are OpenAI-style JSON)::

    GET    /admin/workers                     list workers with health, load, circuit and warm state
    POST   /admin/workers                     add a worker (body: a ``workers[]`` entry of the YAML); one health
                                              check first: a worker that does not answer is added unhealthy
    DELETE /admin/workers/{id}                remove: index entries cleared, sessions dropped at once
    POST   /admin/workers/{id}/drain          no new requests (in-flight streams finish)
    POST   /admin/workers/{id}/undrain
    GET    /admin/sessions?limit=N&<filter>   live sessions, most recently used first, each with ``age_s`` and
                                              ``idle_s``; ``num_sessions`` counts every live one (``limit``
                                              clamped to 1..10,000; one that is not an integer is a 400)
    DELETE /admin/sessions?<filter>           forget every session the filter takes (``all=true`` for every
                                              session); answers ``{"num_dropped": N}``
    DELETE /admin/sessions/{key}              forget one session
    GET    /admin/index                       index stats per model
    POST   /admin/index/clear                 clear every worker's entries (body ``{"worker_id": ...}`` for one),
                                              then re-warm them as after a resync (``clear_index``)
    GET    /admin/policy                      the policy config and learned speed factors
    PUT    /admin/policy                      replace the policy (validated first; the old one stays on error)
    GET    /admin/decisions?limit=N           recent decisions with every candidate's score and cost terms
    GET    /admin/debug/memory?limit=N        top allocation sites of a tracemalloc snapshot (a gateway started
                                              with PYTHONTRACEMALLOC=<frames>; ``group_by=traceback`` for whole
                                              stacks), the C heap's in-use and free bytes (``trim=1``: after
                                              ``malloc_trim``); ``common.process_stats``

Session filters (query parameters, every one given must hold; ``router.sessions.base.SessionFilter``):
``worker_id=<id>`` (owned by that worker), ``key_prefix=<p>`` (keys are ``<source>:<value>``: ``sid:`` for
``x-session-id`` sessions, ``user:`` for the body's ``user``), ``min_idle_s=<s>`` / ``max_idle_s=<s>`` (unused for at
least / at most that long), ``min_age_s=<s>`` (created at least that long ago). A parameter the route does not take,
or a value that is not a non-negative number, is a 400 naming it.

The ``Bearer`` scheme is matched case-insensitively (RFC 7235: ``bearer <token>`` works too), the token exactly.
An unexpected failure of a handler is a JSON 500 (``internal_error``), never aiohttp's plain-text one. With
``admin.disable_auth: true`` the token check is skipped (local use only).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from common.process_stats import MemoryQueryError, memory_report_for_query
from policies import PolicyError, build_policy, decode_policy_config, encode_policy_config
from router.api import error_response
from router.config import decode_worker
from router.decisions import DecisionRecord
from router.errors import (
    AuthError,
    ConfigError,
    GatewayError,
    InvalidFieldError,
    InvalidJSONError,
    NotFoundError,
    unreadable_body_error,
)
from router.gateway import GATEWAY
from router.sessions.base import SessionFilter

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


def _query_once(request: web.Request, name: str) -> str | None:
    """The query parameter ``name`` (``None`` when absent).

    Raises:
        InvalidFieldError: given more than once (``?worker_id=a&worker_id=b`` would act on ``a`` alone).
    """
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise InvalidFieldError(f"{name} is given {len(values)} times; give it once", param=name)
    return values[0] if values else None


def _is_plain(raw: str) -> bool:
    """Whether ``raw`` has none of what Python's ``int`` and ``float`` accept beyond a plain number (``1_000``,
    blanks around it)."""
    return "_" not in raw and raw.strip() == raw


def _query_int(request: web.Request, name: str, default: int) -> int:
    """The integer query parameter ``name`` (``default`` when absent).

    Raises:
        InvalidFieldError: present but not a decimal integer (``?limit=false``, ``?limit=``, ``?limit=1_0``), or
            given more than once.
    """
    raw = _query_once(request, name)
    if raw is None:
        return default
    try:
        if not _is_plain(raw):
            raise ValueError(raw)
        return int(raw)
    except ValueError:
        raise InvalidFieldError(f"{name} must be an integer, got {raw[:40]!r}", param=name) from None


def _limit(request: web.Request, default: int = 100) -> int:
    """``?limit=N`` clamped to 1..10,000 (``default`` when absent).

    Raises:
        InvalidFieldError: not an integer.
    """
    return max(1, min(10_000, _query_int(request, "limit", default)))


_TOO_DEEP = "the request body is not valid JSON: it nests too deeply"
"""msgspec raises ``RecursionError`` at the interpreter's recursion limit (about 1,000 levels of arrays or objects,
even inside a key it would reject); such a body is refused as invalid JSON."""


async def _read(request: web.Request) -> bytes:
    """The body as the client sent it, inflated when it has a ``Content-Encoding`` aiohttp decodes.

    Raises:
        InvalidJSONError: the body does not decode (e.g. a ``gzip`` body that is not gzip).
    """
    try:
        return await request.read()
    except web.RequestPayloadError as exc:
        raise unreadable_body_error(exc) from exc


async def _body(request: web.Request) -> object:
    """The JSON body as builtins (``{}`` when empty).

    Raises:
        InvalidJSONError: not JSON, nested too deeply, or not decodable.
    """
    raw = await _read(request)
    try:
        return msgspec.json.decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidJSONError(_TOO_DEEP) from exc


def _authorization_bytes(request: web.Request) -> bytes:
    """The ``Authorization`` header's bytes as the client sent them (``b""`` when absent).

    aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so encoding back the same way gives the
    original bytes, non-UTF-8 ones included; a value that still cannot be encoded (no client can produce one)
    reads as empty, hence as a wrong token.
    """
    try:
        return request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return b""


def _bearer_credentials(authorization: bytes) -> bytes | None:
    """The credentials of a ``Bearer`` ``Authorization`` value, or ``None`` for another scheme (or none).

    The scheme is case-insensitive and one or more spaces follow it (RFC 7235 section 2.1: ``credentials =
    auth-scheme [ 1*SP ( token68 / #auth-param ) ]``).
    """
    scheme, sep, rest = authorization.partition(b" ")
    if not sep or scheme.lower() != b"bearer":
        return None
    return rest.lstrip(b" ")


def _guard(token: str | None, handler: Handler) -> Handler:
    # Compared as bytes (constant time): a token from the environment carries its non-UTF-8 bytes as surrogates,
    # encoded back the same way as the client's header.
    expected = token.encode("utf-8", "surrogateescape") if token is not None else None

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            if expected is not None:
                credentials = _bearer_credentials(_authorization_bytes(request))
                if credentials is None or not hmac.compare_digest(credentials, expected):
                    raise AuthError("missing or wrong admin bearer token")
            return await handler(request)
        except GatewayError as exc:
            return error_response(exc)
        except web.HTTPException:
            raise
        except Exception as exc:
            logger.exception("admin %s %s failed", request.method, request.path)
            return error_response(GatewayError(f"internal error: {type(exc).__name__}: {exc}"))

    return guarded


async def list_workers(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    now_s = gw.clock()
    return _json({"workers": [w.info(now_s) for w in gw.fleet.workers.values()]})


async def add_worker(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    worker = await gw.add_worker(decode_worker(await _body(request)))
    await gw.fleet.probe_added(worker)  # the answer tells whether it is reachable
    return _json(worker.info(gw.clock()), status=201)


async def remove_worker(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    worker = await gw.remove_worker(request.match_info["worker_id"])
    return _json({"removed": worker.worker_id})


async def drain_worker(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    worker = gw.fleet.set_draining(request.match_info["worker_id"], True)
    return _json(worker.info(gw.clock()))


async def undrain_worker(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    worker = gw.fleet.set_draining(request.match_info["worker_id"], False)
    return _json(worker.info(gw.clock()))


_SESSION_SECONDS = ("min_idle_s", "max_idle_s", "min_age_s")


def _session_filter(request: web.Request, extra: tuple[str, ...]) -> SessionFilter:
    """The ``SessionFilter`` of a ``/admin/sessions`` query (module docstring); ``extra`` are the other parameters
    the route takes.

    Raises:
        InvalidFieldError: a parameter the route does not take or given more than once, a duration that is not
            a finite number >= 0 (or not written plainly: ``1_000``), or an empty ``worker_id``.
    """
    query = request.query
    for name in query:
        if name not in (*_SESSION_SECONDS, "worker_id", "key_prefix", *extra):
            raise InvalidFieldError(
                f"unknown query parameter {name[:40]!r}: /admin/sessions takes worker_id, key_prefix, "
                f"{', '.join(_SESSION_SECONDS)} and {', '.join(extra)}", param=name[:40])
        _query_once(request, name)
    seconds: dict[str, float] = {}
    for name in _SESSION_SECONDS:
        raw = query.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) if _is_plain(raw) else -1.0
        except ValueError:
            value = -1.0
        if not 0 <= value < float("inf"):
            raise InvalidFieldError(f"{name} must be a number of seconds >= 0, got {raw[:40]!r}", param=name)
        seconds[name] = value
    worker_id = query.get("worker_id")
    if worker_id == "":
        raise InvalidFieldError("worker_id must not be empty", param="worker_id")
    return SessionFilter(worker_id=worker_id, key_prefix=query.get("key_prefix", ""),
                         min_idle_s=seconds.get("min_idle_s", 0.0), max_idle_s=seconds.get("max_idle_s"),
                         min_age_s=seconds.get("min_age_s", 0.0))


async def list_sessions(request: web.Request) -> web.StreamResponse:
    """``GET /admin/sessions``: ``{"num_sessions": <every live session>, "sessions": [{"session_key",
    "worker_id", "last_used_s", "created_s", "idle_s", "age_s"}, ...]}`` (``router.sessions.base.SessionInfo``;
    the ``_s`` times on the store's clock), most recently used first, at most ``limit`` (100 by default)."""
    gw = request.app[GATEWAY]
    match = _session_filter(request, ("limit",))
    entries = await gw.sessions.find_sessions(match, _limit(request))
    return _json({"num_sessions": await gw.sessions.num_sessions(),
                  "sessions": [msgspec.to_builtins(e) for e in entries]})


async def drop_sessions(request: web.Request) -> web.StreamResponse:
    """``DELETE /admin/sessions?<filter>``: forget every session the filter takes; ``{"num_dropped": N}``. With no
    filter it takes ``all=true`` (forget every session), so that a bare call cannot empty the table by mistake."""
    gw = request.app[GATEWAY]
    match = _session_filter(request, ("all",))
    is_all = request.query.get("all")
    if is_all not in (None, "true", "false"):
        raise InvalidFieldError(f"all must be true or false, got {is_all[:40]!r}", param="all")
    if match.is_everything and is_all != "true":
        raise InvalidFieldError("give a filter (worker_id, key_prefix, min_idle_s, max_idle_s, min_age_s) or "
                                "all=true to drop every session", param="all")
    num_dropped = await gw.sessions.drop_sessions(match)
    logger.info("admin: %d sessions dropped (%s)", num_dropped,
                ", ".join(f"{k}={v!r}" for k, v in msgspec.structs.asdict(match).items() if v) or "all")
    return _json({"num_dropped": num_dropped})


async def drop_session(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    key = request.match_info["key"]
    if not await gw.sessions.drop(key):
        raise NotFoundError(f"no session {key!r}")
    return _json({"dropped": key})


async def index_stats(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    return _json({name: msgspec.to_builtins(index.stats()) for name, index in gw.indexes.items()})


_JSON_TYPE_NAMES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
                    list: "an array", dict: "an object"}


def _clear_target(body: object) -> str | None:
    """The worker id a ``POST /admin/index/clear`` body names, or ``None`` for every worker.

    Raises:
        InvalidJSONError: the body is not a JSON object (``[]``, ``null``...).
        InvalidFieldError: a key other than ``worker_id``, or a ``worker_id`` that is not a non-empty string.
    """
    if not isinstance(body, dict):
        raise InvalidJSONError(
            f'the body must be a JSON object: none or {{}} to clear every worker, {{"worker_id": "<id>"}} for one; '
            f"got {_JSON_TYPE_NAMES.get(type(body), 'another value')}")
    unknown = [key for key in body if key != "worker_id"]
    if unknown:
        raise InvalidFieldError(f"unknown key {unknown[0]!r}: the body takes only worker_id", param=unknown[0])
    if "worker_id" not in body:
        return None
    worker_id = body["worker_id"]
    if not isinstance(worker_id, str) or not worker_id:
        got = "an empty string" if worker_id == "" else _JSON_TYPE_NAMES.get(type(worker_id), "another value")
        raise InvalidFieldError(f"worker_id must be a worker id (a non-empty string), got {got}", param="worker_id")
    return worker_id


async def clear_index(request: web.Request) -> web.StreamResponse:
    """``POST /admin/index/clear``: drop index entries, then rebuild them from the workers.

    Body: none or ``{}`` clears every worker's entries (of every tier, pools included); ``{"worker_id": "<id>"}``
    one worker's. Anything else is a 400 naming the problem (another JSON value, another key, a ``worker_id`` that
    is not a string); an unknown worker is a 404. Answers ``{"cleared": [<worker ids>]}``.

    A cleared worker that publishes events is then re-warmed as after a resync the fleet detects
    (``router.event_path``): it is routed on approximate entries meanwhile, and its entries are rebuilt from its
    snapshot where it serves one (``snapshot_path``, with ``events.warmup_from_snapshot``), else from its new
    events; it turns warm again when the snapshot is applied (or on its first event batch). So its predictions
    recover while it still holds the blocks. A worker without events keeps routing in approximate mode.
    """
    gw = request.app[GATEWAY]
    worker_id = _clear_target(await _body(request))
    targets = [gw.fleet.get(worker_id)] if worker_id is not None else list(gw.fleet.workers.values())
    cleared = []
    for worker in targets:
        if gw.events.clear_worker(worker.worker_id) or worker_id is not None:
            cleared.append(worker.worker_id)
    gw.heap.request()
    logger.info("admin: index entries of %s cleared; workers publishing events re-warm",
                ", ".join(cleared) or "no worker")
    return _json({"cleared": cleared})


async def get_policy(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    calibrator = gw.holder.calibrator
    return _json({
        "policy": encode_policy_config(gw.holder.config),
        "speed_factors": calibrator.speed_factors() if calibrator is not None else {},
    })


async def put_policy(request: web.Request) -> web.StreamResponse:
    """Validate, build and install a new policy; on any error the old one keeps serving. The body is a policy
    object, or ``GET /admin/policy``'s answer (the policy under ``"policy"``)."""
    gw = request.app[GATEWAY]
    raw = await _read(request)
    payload: object = raw
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        obj = None  # decode_policy_config reports it
    if isinstance(obj, dict) and "name" not in obj and isinstance(obj.get("policy"), dict):
        payload = obj["policy"]
    try:
        config = decode_policy_config(payload)
        policy = build_policy(config, previous=gw.holder.policy)
    except PolicyError as exc:
        raise ConfigError(f"policy: {exc}", param=getattr(exc, "key", None)) from exc
    except RecursionError as exc:  # the tagged union scans ahead for ``name`` through any nesting
        raise InvalidJSONError(_TOO_DEEP) from exc
    gw.holder.set(config, policy)
    logger.info("policy replaced: %s", policy.name)
    return _json({"policy": encode_policy_config(config)})


async def recent_decisions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    records = gw.router.recent.latest(_limit(request))
    records.reverse()
    now_s = gw.clock()
    decisions = []
    hidden = ("request", "snapshot", "policy")
    for record in records:  # ``at_s`` is the gateway's monotonic clock; ``age_s`` reads without it
        item = msgspec.to_builtins({f: getattr(record, f) for f in record.__struct_fields__ if f not in hidden})
        if isinstance(record, DecisionRecord):  # a prefill/decode pair's record has no candidate costs
            item["cost_terms"] = record.cost_terms()
            item["answer"] = gw.router.recent.answer(record.request_id)  # None while in flight
        item["age_s"] = round(max(0.0, now_s - record.at_s), 3)
        decisions.append(item)
    return _json({"decisions": decisions})


async def debug_memory(request: web.Request) -> web.StreamResponse:
    """``GET /admin/debug/memory?limit=N&group_by=lineno|traceback&trim=true&collect=true``:
    ``common.process_stats.memory_report`` (25 sites by default, by line, no trim, no collection); a ``limit`` not
    an integer, a ``group_by`` not one of the two or a ``trim`` or ``collect`` not ``true``/``false`` (``1``/``0``)
    is a 400 naming it."""
    try:
        report = memory_report_for_query(request.query)
    except MemoryQueryError as exc:
        raise InvalidFieldError(str(exc), param=exc.param) from None
    return _json(report)


def add_admin_routes(app: web.Application, token: str | None) -> None:
    """Register every admin route, each guarded by ``token`` (``None``: auth disabled)."""
    r = app.router
    r.add_get("/admin/workers", _guard(token, list_workers))
    r.add_post("/admin/workers", _guard(token, add_worker))
    r.add_delete("/admin/workers/{worker_id}", _guard(token, remove_worker))
    r.add_post("/admin/workers/{worker_id}/drain", _guard(token, drain_worker))
    r.add_post("/admin/workers/{worker_id}/undrain", _guard(token, undrain_worker))
    r.add_get("/admin/sessions", _guard(token, list_sessions))
    r.add_delete("/admin/sessions", _guard(token, drop_sessions))
    r.add_delete("/admin/sessions/{key}", _guard(token, drop_session))
    r.add_get("/admin/index", _guard(token, index_stats))
    r.add_post("/admin/index/clear", _guard(token, clear_index))
    r.add_get("/admin/policy", _guard(token, get_policy))
    r.add_put("/admin/policy", _guard(token, put_policy))
    r.add_get("/admin/decisions", _guard(token, recent_decisions))
    r.add_get("/admin/debug/memory", _guard(token, debug_memory))
