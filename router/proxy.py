"""Forwarding a routed request to its worker: retries before the first byte, passthrough, accounting, honesty.

``Proxy.forward`` walks the plan's workers best first. An attempt that fails **before the first byte** (connect
error, first-byte timeout, or a 5xx status, all before anything was written to the client) is abandoned and
the next worker is tried after a backoff (``RetryConfig``); once the response has started, it is relayed to the
end and never retried. The body is relayed exactly as received: SSE chunks are written as they arrive, cut at
event ends (``router.sse.SseFramer``; never re-decoded or re-encoded), a non-streaming body is written as one block.

A worker that breaks its answer after its headers (it died, its connection reset, a read timeout) is a failed
request, settled as one (the lease's circuit-breaker verdict is a failure, the index's pending entries are
withdrawn, the session does not follow it): a non-streamed answer is a 502 (nothing was sent yet); an event stream
ends with an OpenAI error event and ``data: [DONE]`` (``router.sse.error_event``, as vLLM ends a stream that fails)
after its last whole event. Another kind of stream (not ``text/event-stream``) has no event to end it with: its
client connection is aborted, so it never looks complete. Both are counted in ``stream_errors_total{worker}``.
A stream still relayed when a graceful stop's grace is over ends the same way, with ``GatewayStoppingError``
(``router.drain``; not the worker's failure, not counted there).

Accounting per worker: each attempt holds a ``WorkerLease`` (``router.lease``: in-flight requests and prompt tokens,
pending prefill tokens until the first byte, decoding requests, the circuit breaker's verdict), taken from the
request's lifecycle (``AttemptHooks.pre_request``) and released when the attempt ends, on every path, including a
client disconnect, which cancels the handler and closes the upstream request.

``forward`` returns an immutable ``ProxyOutcome`` (the response, the worker whose answer was relayed, its status,
the cached tokens it reported, or the error when every attempt failed); ``router.lifecycle.RequestFlight.finish``
settles the request from it.

Honesty check (DESIGN.md §7b): ``usage.prompt_tokens_details.cached_tokens`` is read from the non-streamed body
or from the last SSE ``data:`` event that carries ``usage`` (found by scanning a bounded tail of the stream, no
re-encoding) and compared with the cached tokens predicted for the worker that served the request. A stream's
observed time to first token goes to the lifecycle (``AttemptHooks.on_first_token``), which feeds the policy's TTFT
calibrator.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import msgspec
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.config import DEFAULT_MAX_RESPONSE_BYTES, RetryConfig
from router.drain import Drain, GatewayStoppingError, end_stream
from router.errors import GatewayError, TransportError, TransportTimeoutError, UpstreamError, UpstreamTimeoutError
from router.fleet import WorkerRuntime
from router.lease import WorkerLease
from router.metrics import GatewayMetrics, WorkerMetrics
from router.routing import RoutePlan
from router.sse import (
    SSE_TAIL_BYTES,
    SseFramer,
    Usage,
    cached_tokens_of,
    is_event_stream,
    usage_from_body,
    usage_from_sse_tail,
)
from router.transport import HOP_BY_HOP_HEADERS, Transport, UpstreamRequest, UpstreamResponse

logger = logging.getLogger(__name__)

WORKER_HEADER = "x-kvgate-worker"
PREDICTED_HEADER = "x-kvgate-predicted-cached-tokens"
DECISION_HEADER = "x-kvgate-decision"
REQUEST_ID_HEADER = "x-request-id"
_FORBIDDEN_HEADER_CHAR = re.compile("[\x00-\x08\x0a-\x1f\x7f]")
"""A character a header value may not carry (RFC 9110 §5.5; aiohttp refuses to send it)."""


AUTO_HEADER_BITS = {"user-agent": 1, "accept-encoding": 2, "content-type": 4}
"""Headers the HTTP client adds when absent (one bit each); the ones a client did not send are skipped."""
ALL_AUTO_HEADERS = 7
ROUTING_HEADERS = ("x-session-id", "x-smg-routing-key", "x-kvgate-worker", "x-smg-target-worker")
"""Request headers routing reads (session keys, forced worker); forwarded like any other."""
DECODED_BODY_HEADERS = ("content-encoding",)
"""Request headers that describe the body as the client encoded it, dropped when forwarding: aiohttp's server
inflates a ``gzip``/``deflate``/``br`` body before the gateway reads it (a body it does not inflate fails to parse
as JSON and is refused), so the worker is sent the inflated body, which no longer has that encoding."""
_HOP_BY_HOP = -1
_ROUTING = 8
_REQUEST_ID = 16
_HEADER_ROLES: dict[str, int] = {
    **{name: _HOP_BY_HOP for name in (*HOP_BY_HOP_HEADERS, *DECODED_BODY_HEADERS)}, **AUTO_HEADER_BITS,
    **{name: _ROUTING for name in ROUTING_HEADERS}, REQUEST_ID_HEADER: _REQUEST_ID,
}
"""Lower-cased header name -> its role: dropped (hop-by-hop, or ``DECODED_BODY_HEADERS``), an auto header bit,
routing, or the request id."""

MAX_MEMO_BLOCK_CHARS = 4096
"""``ClientHeaderReader`` memoizes a header block only below this many characters (names plus values): an SDK's
usual block is a few hundred; a larger one is read on every request instead of being retained."""


class ClientHeaders(msgspec.Struct, frozen=True, gc=False):
    """What one pass over a client's request headers gives (shared by every request with the same header block:
    read only).

    Attributes:
        forward: the headers to send upstream: the client's without the dropped ones (hop-by-hop,
            ``DECODED_BODY_HEADERS``; the proxy adds ``x-request-id``).
        skip_auto_headers: names in ``AUTO_HEADER_BITS`` the client did not send (the HTTP client must not add
            them).
        routing: the first non-empty value of each of ``ROUTING_HEADERS`` the client sent, by lower-cased name.
        request_id: the client's ``x-request-id`` (first non-empty one), kept as the request's id, or ``None``.
        num_chars: characters in the block's names and values, dropped headers included except
            ``Content-Length`` (which the memo's key leaves out, so a memoized block's count holds for every
            length; the decoded text of its bytes: one character per 1 to 4 bytes).
    """

    forward: tuple[tuple[str, str], ...]
    skip_auto_headers: tuple[str, ...]
    routing: dict[str, str]
    request_id: str | None = None
    num_chars: int = 0


def client_headers_of(headers: Mapping[str, str]) -> ClientHeaders:
    """Read a client's request headers once: the ones to forward, the auto headers it did not send, and the
    routing headers (see ``ClientHeaders``)."""
    out: list[tuple[str, str]] = []
    routing: dict[str, str] = {}
    request_id: str | None = None
    seen = 0
    num_chars = 0
    roles = _HEADER_ROLES
    for name, value in headers.items():
        lower = name.lower()
        role = roles.get(lower)
        if lower != "content-length":
            num_chars += len(name) + len(value)
        if role is not None:
            if role == _HOP_BY_HOP:
                continue
            if role == _ROUTING:
                if value and lower not in routing:
                    routing[lower] = value
            elif role == _REQUEST_ID:
                if value and request_id is None:
                    request_id = value
            else:
                seen |= role
        out.append((name, value))
    skip = () if seen == ALL_AUTO_HEADERS else tuple(name for name, bit in AUTO_HEADER_BITS.items() if not seen & bit)
    return ClientHeaders(tuple(out), skip, routing, request_id, num_chars)


CONTENT_LENGTH_SPELLINGS = frozenset({b"Content-Length", b"content-length", b"CONTENT-LENGTH"})
"""The raw spellings of ``Content-Length`` that ``ClientHeaderReader`` leaves out of its memo's key (a set lookup
per header; a block spelling it otherwise keeps its length in the key, so it is memoized per length, still
correct)."""


class ClientHeaderReader:
    """``client_headers_of`` behind a bounded memo keyed by the raw header block less its ``Content-Length``.

    A client sends the same headers request after request (an SDK's user agent, its API key, a session id for a
    conversation), so the pass over them runs once per distinct header block; the memo is cleared when it holds
    ``max_entries`` blocks. Keys are aiohttp's ``raw_headers`` (name and value bytes as received, in order)
    without the entries spelled as in ``CONTENT_LENGTH_SPELLINGS``, so two blocks share an entry when they are
    byte-identical but for the body's length, as a client's POSTs are. ``Content-Length`` is never forwarded (it is
    hop-by-hop here: the HTTP client writes the forwarded body's own length) and ``ClientHeaders`` holds nothing
    read from it, so one entry is right for every length. A block with an ``x-request-id`` is unique to
    its request: it is read every time and never memoized; so is a block of ``MAX_MEMO_BLOCK_CHARS`` characters
    or more (a client varying large headers would otherwise keep up to ``max_entries`` of them, raw and decoded,
    alive). The memo therefore holds at most ``max_entries * MAX_MEMO_BLOCK_CHARS * 4`` raw header bytes
    (16 MiB by default) plus their decoded copies.
    """

    __slots__ = ("_memo", "_max_entries")

    def __init__(self, max_entries: int = 1024) -> None:
        self._memo: dict[tuple[tuple[bytes, bytes], ...], ClientHeaders] = {}
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._memo)

    def clear(self) -> None:
        """Forget every memoized block (the fleet emptied: ``Gateway`` releases what served its requests)."""
        self._memo.clear()

    def read(self, raw_headers: tuple[tuple[bytes, bytes], ...], headers: Mapping[str, str]) -> ClientHeaders:
        """The ``ClientHeaders`` of a request (``raw_headers`` and ``headers`` are the same block: aiohttp's
        ``request.raw_headers`` and ``request.headers``)."""
        spellings = CONTENT_LENGTH_SPELLINGS
        key = tuple([pair for pair in raw_headers if pair[0] not in spellings])
        got = self._memo.get(key)
        if got is None:
            got = client_headers_of(headers)
            if got.request_id is None and got.num_chars < MAX_MEMO_BLOCK_CHARS:
                if len(self._memo) >= self._max_entries:
                    self._memo.clear()
                self._memo[key] = got
        return got


def response_headers_of(
    upstream: Mapping[str, str], worker_id: str, predicted_cached_tokens: int, reason: str, request_id: str,
) -> CIMultiDict[str]:
    """The worker's response headers without hop-by-hop ones, plus kvgate's four (worker, predicted cached tokens,
    decision reason, request id). Repeated headers (``Set-Cookie``) stay repeated, in order. A header whose value
    holds a control character (RFC 9110 §5.5: none but tab) is dropped and logged. aiohttp's headers
    (``CIMultiDictProxy``) are copied and their hop-by-hop names found in C (case-insensitive key views); any
    other mapping is filtered name by name."""
    if isinstance(upstream, CIMultiDictProxy):
        headers = CIMultiDict(upstream)
        for name in upstream.keys() & HOP_BY_HOP_HEADERS:
            headers.popall(name)
    else:
        headers = CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in HOP_BY_HOP_HEADERS)
    values = "".join(headers.values())
    # isprintable() is False for every forbidden character (and for tab and some non-ASCII ones the regex allows).
    if not values.isprintable() and _FORBIDDEN_HEADER_CHAR.search(values):  # aiohttp would refuse to send them
        bad = [k for k, v in headers.items() if _FORBIDDEN_HEADER_CHAR.search(v)]
        logger.warning("worker %s sent header(s) %s with control characters; dropped", worker_id, ", ".join(bad))
        headers = CIMultiDict((k, v) for k, v in headers.items() if not _FORBIDDEN_HEADER_CHAR.search(v))
    headers[WORKER_HEADER] = worker_id
    headers[PREDICTED_HEADER] = str(predicted_cached_tokens)
    headers[DECISION_HEADER] = reason
    headers[REQUEST_ID_HEADER] = request_id
    return headers


class _BodyResponse(web.StreamResponse):
    """A response written once with its length: headers wait for the body and leave with it in one write, as
    aiohttp's ``web.Response`` sends them (a class setting of aiohttp's; were it renamed, headers would go out on
    ``prepare``, one write earlier, with the same bytes), without ``web.Response``'s body-type dispatch."""

    _send_headers_immediately = False


class ProxyOutcome(msgspec.Struct, frozen=True, gc=False):
    """What forwarding one request came to (read only; ``RequestFlight.finish`` settles the request from it).

    Attributes:
        response: the response relayed to the client, or ``None`` when every attempt failed (``error``).
        served_by: the worker whose answer was relayed (it began before the client left), or ``None``.
        status: the status relayed, or ``None``.
        error: the error to answer with (every attempt failed before the first byte), or ``None``.
        reported_cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` the worker reported, or ``None``
            (no usage, or a status other than 200).
        has_client_bytes: the response's headers were sent to the client.
        is_client_gone: the client left before the answer's end (the handler was cancelled).

    ``error`` with a ``response``: the worker broke a relayed stream after its headers (the client got the error
    as the stream's last event); the request failed like one with no response.
    """

    response: web.StreamResponse | None
    served_by: WorkerRuntime | None
    status: int | None
    error: GatewayError | None = None
    reported_cached_tokens: int | None = None
    has_client_bytes: bool = False
    is_client_gone: bool = False

    @property
    def is_ok(self) -> bool:
        """The request succeeded: an answer below 400 relayed whole."""
        return self.error is None and self.status is not None and self.status < 400


class AttemptHooks(Protocol):
    """What the proxy tells the request's lifecycle (``router.lifecycle.RequestFlight``), at the request-control
    extension points of the Gateway API Inference Extension that llm-d's scheduler plugs into
    (``pkg/epp/requestcontrol/plugins.go``): ``pre_request`` (PreRequest) before each attempt is sent,
    ``response_received`` (ResponseReceived) when an answer's headers are accepted for relay, ``on_first_token``
    (the first ResponseStreaming) when a stream's first chunk arrives; ResponseComplete is the lifecycle's
    ``finish``, given the ``ProxyOutcome`` returned."""

    def pre_request(self, worker: WorkerRuntime, num_uncached_tokens: int) -> WorkerLease:
        """The attempt's lease on ``worker`` (acquired; the proxy releases it when the attempt ends)."""
        ...

    def response_received(self, lease: WorkerLease, status: int) -> None:
        """The answer of ``lease``'s worker, with ``status``, is relayed (no retry after this)."""
        ...

    def on_first_token(self, lease: WorkerLease, ttft_s: float) -> None:
        """A stream's first chunk came after ``ttft_s`` (in the worker's seconds)."""
        ...


RetryBody = Callable[[WorkerRuntime, Exception | None, int | None], Awaitable[bytes | None]]
"""``Proxy.forward``'s ``retry_body``: (the next worker, the last error, its status) -> the body, or ``None``."""


def _after_headers_error(exc: TransportError) -> UpstreamError:
    error = (UpstreamTimeoutError if isinstance(exc, TransportTimeoutError) else UpstreamError)(
        f"the worker's answer broke after its headers: {exc.message}", worker_id=exc.worker_id,
        endpoint=exc.endpoint)
    error.__cause__ = exc
    return error


def _oversized(worker_id: str, max_bytes: int, detail: str) -> UpstreamError:
    logger.warning("worker %s answered more than max_response_bytes (%d): %s", worker_id, max_bytes, detail)
    return UpstreamError(f"the worker's answer is over the gateway's max_response_bytes ({max_bytes}): {detail}",
                         worker_id=worker_id)


class Proxy:
    """Sends requests along a ``RoutePlan`` and relays the response.

    ``max_response_bytes`` caps a non-streamed answer, which is read whole before it is relayed (a stream is
    relayed chunk by chunk and has no cap): past it the client gets a 502 (``upstream_error``).
    """

    def __init__(
        self, transport: Transport, retry: RetryConfig, metrics: GatewayMetrics,
        *, clock: Callable[[], float] = time.monotonic, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        drain: Drain | None = None,
    ) -> None:
        self.drain = drain if drain is not None else Drain()  # the streams relayed, for a graceful stop
        self._transport = transport
        self._max_response_bytes = max_response_bytes
        self._retry = retry
        self._metrics = metrics
        self._clock = clock
        self.num_honesty_checks = 0
        self.num_honesty_mismatches = 0
        self._workers_warned_mismatch: set[str] = set()

    async def forward(
        self, request: web.Request, body: bytes, plan: RoutePlan, hooks: AttemptHooks, *, is_stream: bool,
        request_id: str, policy_name: str, received_at: float | None = None,
        client_headers: ClientHeaders | None = None, retry_body: RetryBody | None = None,
    ) -> ProxyOutcome:
        """Send ``body`` to the plan's workers (best first, retrying before the first byte) and relay the answer.

        ``client_headers`` is ``client_headers_of(request.headers)`` when the caller has it (else it is read here);
        ``x-request-id: request_id`` is added to the headers forwarded unless the client sent its own. Each attempt
        holds the ``WorkerLease`` that ``hooks.pre_request`` gives, released when the attempt ends, however.
        ``retry_body``, when given, is awaited before each retry with the worker about to be tried, the previous
        attempt's error and its status (``None`` when it got no answer): the body to send instead (the
        disaggregated path's fresh prefill leg), or ``None`` to skip that worker.

        The served request is counted for the worker that answered (``requests_total``, and
        ``request_duration_seconds`` from ``received_at``, a ``time.perf_counter()`` reading, else from now).

        Returns:
            The outcome; when every attempt failed before the first byte its ``error`` is an ``UpstreamError``
            (502; ``UpstreamTimeoutError``, 504, if the last one timed out).

        Raises:
            asyncio.CancelledError: the client went away (its attempt's lease is released first).
        """
        if client_headers is None:
            client_headers = client_headers_of(request.headers)
        forward_headers: Sequence[tuple[str, str]] = (
            client_headers.forward if client_headers.request_id is not None
            else [*client_headers.forward, (REQUEST_ID_HEADER, request_id)]
        )
        skip_auto_headers = client_headers.skip_auto_headers
        num_prompt_tokens = plan.num_prompt_tokens
        # The chosen worker; when its attempt fails, the rest of the ranking is appended (iteration sees it).
        attempts = [plan.chosen]
        max_retries = self._retry.max_retries
        last_exc: Exception | None = None
        last_status: int | None = None
        for attempt, worker in enumerate(attempts):
            if attempt:
                self._metrics.retries_total.labels(attempts[attempt - 1].worker_id, type(last_exc).__name__).inc()
                await asyncio.sleep(self._retry.backoff_s(attempt))
                if worker.is_draining or not worker.breaker.allows(self._clock()):
                    continue
                if retry_body is not None:
                    new_body = await retry_body(worker, last_exc, last_status)
                    if new_body is None:
                        continue
                    body = new_body
            upstream_req = UpstreamRequest(
                worker.worker_id, worker.config.url, request.method, request.raw_path, forward_headers, body,
                skip_auto_headers,
            )
            predicted = plan.predicted_cached_tokens.get(worker.worker_id, 0)
            lease = hooks.pre_request(worker, max(0, num_prompt_tokens - predicted))
            wm = lease.metrics
            resp: UpstreamResponse | None = None
            try:
                sent_at = time.perf_counter()
                try:
                    resp = await self._transport.send(upstream_req)
                except TransportError as exc:
                    lease.record_failure(self._clock())
                    last_exc = exc
                    last_status = None
                    if attempt == 0:
                        attempts += plan.fallbacks(max_retries)
                    logger.warning("request %s: worker %s failed before the first byte: %s",
                                   request_id, worker.worker_id, exc.message)
                    continue
                status = resp.status
                if status >= 500 or status < 200:
                    if attempt == 0:
                        attempts += plan.fallbacks(max_retries)
                    if status < 200 or attempt + 1 < len(attempts):  # a 1xx final answer is never relayed
                        lease.record_failure(self._clock())
                        last_exc = UpstreamError(f"worker answered {status}", worker_id=worker.worker_id)
                        last_status = status
                        logger.warning("request %s: worker %s answered %d before the first byte%s", request_id,
                                       worker.worker_id, status, "; retrying" if attempt + 1 < len(attempts) else "")
                        continue
                if status >= 500:
                    lease.record_failure(self._clock())
                # else the verdict waits for the body's end: a worker that fails after its headers counts as failing
                hooks.response_received(lease, status)
                headers = response_headers_of(resp.headers, worker.worker_id, predicted,
                                              plan.decision.reason if attempt == 0 else "retry", request_id)
                broken: GatewayError | None = None
                if is_stream and resp.status == 200:
                    out, reported, broken = await self._relay_stream(request, resp, headers, lease, hooks, sent_at,
                                                                     predicted, request_id)
                else:  # the whole body, then one length-framed write (inline: no coroutine per request)
                    lease.on_first_byte(self._clock())  # pending prefill -> decoding
                    try:
                        answer = await self._read_body(resp, worker.worker_id)
                    except TransportError as exc:  # broke after the headers: no retry (the worker may have run it)
                        lease.record_failure(self._clock())
                        logger.warning("request %s: worker %s broke its answer after the headers: %s", request_id,
                                       worker.worker_id, exc.message)
                        return ProxyOutcome(None, None, None, _after_headers_error(exc))
                    except UpstreamError as exc:  # over max_response_bytes
                        return ProxyOutcome(None, None, None, exc)
                    finally:
                        lease.on_last_byte()
                    if status < 500:
                        lease.record_success()
                    out = _BodyResponse(status=resp.status, headers=headers)
                    out.content_length = len(answer)
                    try:
                        await out.prepare(request)
                        if answer:
                            await out.write(answer)
                        await out.write_eof()
                    except ConnectionResetError:
                        logger.info("client went away before the answer of worker %s was sent", worker.worker_id)
                    reported = (self._check_honesty(worker, wm, predicted, usage_from_body(answer))
                                if resp.status == 200 else None)
                wm.count_request(policy_name, out.status,
                                 time.perf_counter() - (received_at if received_at is not None else sent_at))
                return ProxyOutcome(out, worker, out.status, broken, reported, out.prepared)
            finally:
                if resp is not None:
                    resp.release()
                lease.release()
        if isinstance(last_exc, TransportTimeoutError):
            error: GatewayError = UpstreamTimeoutError(
                f"no worker answered in time: {last_exc.message}", worker_id=last_exc.worker_id,
                endpoint=last_exc.endpoint)
        else:
            worker_id = attempts[-1].worker_id if attempts else None
            message = (last_exc.message if isinstance(last_exc, TransportError | UpstreamError)
                       else "no worker reachable")
            error = UpstreamError(f"every attempt failed: {message}", worker_id=worker_id)
        error.__cause__ = last_exc
        return ProxyOutcome(None, None, None, error)

    async def _relay_stream(
        self, request: web.Request, resp: UpstreamResponse, headers: CIMultiDict[str], lease: WorkerLease,
        hooks: AttemptHooks, sent_at: float, predicted: int, request_id: str,
    ) -> tuple[web.StreamResponse, int | None, GatewayError | None]:
        """Relay a 200 stream chunk by chunk, cut at SSE event ends; returns the response, the cached tokens its
        usage reported, and the error it ended with when the worker broke it after its headers (module
        docstring)."""
        worker = lease.worker
        wm = lease.metrics
        out = web.StreamResponse(status=resp.status, headers=headers)
        framer = SseFramer() if is_event_stream(resp.headers.get("Content-Type")) else None
        is_first = True
        recent: list[bytes] = []  # the stream's last chunks, at most 2 * SSE_TAIL_BYTES (joined when over)
        num_recent_bytes = 0
        max_recent_bytes = 2 * SSE_TAIL_BYTES
        broken: GatewayError | None = None
        task = asyncio.current_task()
        assert task is not None
        try:
            await out.prepare(request)
            self.drain.enter(task)
            try:
                async for chunk in resp.iter_chunks():
                    if is_first:  # pending prefill -> decoding; the TTFT to its histogram and the lifecycle
                        is_first = False
                        lease.on_first_byte(self._clock())
                        ttft_s = (time.perf_counter() - sent_at) / worker.config.time_scale  # the worker's seconds
                        wm.ttft_s.observe(ttft_s)
                        hooks.on_first_token(lease, ttft_s)
                    if framer is not None:
                        chunk = framer.feed(chunk)
                        if not chunk:
                            continue
                    await out.write(chunk)
                    recent.append(chunk)
                    num_recent_bytes += len(chunk)
                    if num_recent_bytes > max_recent_bytes:
                        recent = [b"".join(recent)[-SSE_TAIL_BYTES:]]
                        num_recent_bytes = len(recent[0])
            except TransportError as exc:
                lease.record_failure(self._clock())
                broken = _after_headers_error(exc)
                wm.num_stream_errors += 1
                await end_stream(request, out, framer, broken, logger, f"request {request_id}: worker "
                                 f"{worker.worker_id} broke its stream after the headers ({exc.message})")
            except asyncio.CancelledError:
                if not self.drain.take_cancel(task):  # the client left, or a deadline
                    raise
                broken = GatewayStoppingError("the gateway stopped before the answer's end")
                await end_stream(request, out, framer, broken, logger, f"request {request_id}: stopping mid-stream")
            else:
                if framer is not None and framer.num_partial_bytes:
                    rest = framer.rest()  # a last event with no blank line after it: relayed as it came
                    await out.write(rest)
                    recent.append(rest)
                await out.write_eof()
                lease.record_success()
        except ConnectionResetError:
            logger.info("client went away during the stream from worker %s", worker.worker_id)
        finally:  # the usage relayed is read even when the client left after it (the handler cancelled)
            self.drain.leave(task)
            lease.on_last_byte()
            usage = usage_from_sse_tail((recent[0] if len(recent) == 1 else b"".join(recent))[-SSE_TAIL_BYTES:])
            reported = lease.reported_cached_tokens = self._check_honesty(worker, wm, predicted, usage)
        return out, reported, broken

    async def _read_body(self, resp: UpstreamResponse, worker_id: str) -> bytes:
        """A non-streamed answer's whole body, at most ``max_response_bytes``.

        A ``Content-Length`` over the cap is refused before any byte is read; a body without one (chunked) is read
        chunk by chunk and refused once it passes the cap.

        Raises:
            UpstreamError: the body is over ``max_response_bytes`` (502; the connection is closed by ``release``).
            TransportError: the connection broke mid-body.
        """
        max_bytes = self._max_response_bytes
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit():
            if int(length) > max_bytes:
                raise _oversized(worker_id, max_bytes, f"its Content-Length is {length}")
            return await resp.read()
        parts: list[bytes] = []
        num_bytes = 0
        async for chunk in resp.iter_chunks():
            num_bytes += len(chunk)
            if num_bytes > max_bytes:
                raise _oversized(worker_id, max_bytes, f"more than {max_bytes} bytes came")
            parts.append(chunk)
        return b"".join(parts)

    def check_honesty(
        self, worker: WorkerRuntime, wm: WorkerMetrics, predicted: int, usage: Usage | None,
    ) -> int | None:
        """The honesty check of an answer relayed elsewhere (a disaggregated request's prefill leg, ``router.pd``):
        counted like the proxy's own; returns the reported cached tokens (``None`` without usage)."""
        return self._check_honesty(worker, wm, predicted, usage)

    def _check_honesty(
        self, worker: WorkerRuntime, wm: WorkerMetrics, predicted: int, usage: Usage | None,
    ) -> int | None:
        """Count one predicted-vs-reported pair (and the prompt's tokens, the hit ratio's denominator) in the
        proxy's totals and the worker's series; log a mismatch. An answer without usage is counted as unchecked.

        Returns:
            the reported cached tokens (``usage.prompt_tokens_details.cached_tokens``), ``None`` without usage.
        """
        reported = cached_tokens_of(usage)
        if usage is None or reported is None:
            wm.num_checks_unchecked += 1
            return None
        self.num_honesty_checks += 1
        wm.num_predicted_cached_tokens += predicted
        wm.num_reported_cached_tokens += reported
        wm.num_prompt_tokens += usage.prompt_tokens or 0
        if predicted == reported:
            wm.num_checks_match += 1
        else:
            wm.num_checks_mismatch += 1
            self.num_honesty_mismatches += 1
            if worker.worker_id in self._workers_warned_mismatch:
                logger.debug(
                    "cached tokens: predicted %d, worker %s reported %d", predicted, worker.worker_id, reported
                )
            else:
                self._workers_warned_mismatch.add(worker.worker_id)
                logger.warning(
                    "cached tokens: predicted %d, worker %s reported %d (first mismatch for this worker; an "
                    "occasional one comes from requests sharing a prefix that the worker admitted in one step; if "
                    "its predictions stay wrong, check that its KV events reach the gateway: a publisher endpoint "
                    "without '*' connects instead of binding, and the tokenizer, chat template and block size must "
                    "match)",
                    predicted,
                    worker.worker_id,
                    reported,
                )
        return reported
