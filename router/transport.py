"""The transport seam between the gateway and its workers.

The gateway talks to workers only through ``Transport`` (the proxy's ``send(request) -> response``; the fleet's
``get_json`` for health and load, ``get_with_headers`` for snapshots; ``remove_worker``, ``aclose()``), like
httpx's transports: ``AiohttpTransport`` for real workers (one pooled keep-alive connector per worker), and
``MockTransport`` that answers from an async handler in memory, so proxy tests need no socket.

An ``UpstreamResponse`` is returned once the status and headers arrived (the "first byte"); its body is read
with ``iter_chunks()`` (chunk by chunk, as received, never re-encoded) or ``read()``, and ``release()`` must be
called on every path (it closes the upstream request if the body was not fully read, which cancels it).

Timeouts (``TimeoutsConfig``): the first-byte and total deadlines of every request in flight sit in two FIFOs, each
on one loop timer (``Deadlines``), instead of aiohttp's per-request timer, which also wraps every wait for a body
chunk. A deadline that passes cancels the request's task: while it waits for the headers, the send raises
``TransportTimeoutError``; while it waits for a body chunk, the read raises ``TransportTimeoutError`` (after the
first byte); while the task is writing to its client, the cancellation ends the request there (the client's
response is cut).

aiohttp's errors become the gateway's (``router.errors``: ``TransportConnectError``, ``TransportTimeoutError``,
``TransportError``) in one function, ``map_aiohttp_error``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Literal, Protocol

import aiohttp
import msgspec
from aiohttp.streams import EofStream
from yarl import URL

from router.config import TimeoutsConfig
from router.errors import TransportConnectError, TransportError, TransportTimeoutError, TransportUnreachedError

logger = logging.getLogger(__name__)

HOP_BY_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
     "transfer-encoding", "upgrade", "content-length", "host"}
)
"""RFC 9110 §7.6.1 connection-specific headers (plus ``host``/``content-length``, recomputed by the client)."""


class UpstreamRequest(msgspec.Struct, frozen=True, gc=False):
    """One request to a worker.

    Attributes:
        worker_id: the worker.
        base_url: its HTTP base URL, e.g. ``http://127.0.0.1:8001``.
        method: HTTP method.
        path: path with query, e.g. ``/v1/chat/completions``.
        headers: headers to send (hop-by-hop headers already removed).
        body: the body exactly as the client sent it.
        skip_auto_headers: headers the client did not send that the HTTP client must not add on its own
            (``User-Agent``, ``Accept-Encoding``, ``Content-Type``): the worker sees only what the client sent.
    """

    worker_id: str
    base_url: str
    method: str
    path: str
    headers: Sequence[tuple[str, str]]
    body: bytes
    skip_auto_headers: tuple[str, ...] = ()


class UpstreamResponse(Protocol):
    """A worker's response whose status and headers have arrived."""

    status: int
    headers: Mapping[str, str]

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive.

        Raises:
            TransportError: the connection broke mid-body (``is_before_first_byte`` False).
        """
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def release(self) -> None:
        """Return the connection to the pool, or close it if the body was not fully read. Idempotent."""
        ...


class Transport(Protocol):
    """Sends requests to workers."""

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send ``request`` and wait for the response headers.

        Raises:
            TransportConnectError: no connection, or it closed before the headers.
            TransportTimeoutError: connect or first-byte timeout.
        """
        ...

    async def get_with_headers(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
        """GET ``url`` on the worker's pool: ``(status, headers with lower-cased names, body)``.

        Raises:
            TransportError: connect error or timeout.
        """
        ...

    async def get_json(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, object]:
        """GET ``url`` on the worker's pool (health and load checks): ``(status, body decoded as JSON, None when
        empty or not JSON)``.

        Raises:
            TransportError: connect error or timeout.
        """
        ...

    async def remove_worker(self, worker_id: str, *, is_idle: Callable[[], bool] | None = None) -> None:
        """Close the worker's pooled connections: at once, or (``is_idle`` given) once ``is_idle()`` turns true,
        so requests in flight are relayed to their end first. A request sent under the same worker id afterwards
        opens a new pool."""
        ...

    async def aclose(self) -> None:
        """Close every pooled connection."""
        ...


Stage = Literal["headers", "body", "get"]
"""Where an aiohttp error happened: waiting for a request's headers (before the first byte), reading its body
(after it), or in a plain GET (health, load, snapshot)."""


def map_aiohttp_error(exc: BaseException, stage: Stage, worker_id: str, url: str) -> TransportError:
    """The gateway's error for an aiohttp (or timeout) error, the one place aiohttp's errors are mapped (as httpx's
    ``map_httpcore_exceptions`` in ``httpx/_transports/default.py`` maps httpcore's)::

        stage     TimeoutError (incl. aiohttp.ServerTimeoutError)   other aiohttp.ClientError
        headers   TransportTimeoutError, before the first byte       TransportConnectError, before the first byte
        get       TransportTimeoutError, before the first byte       TransportConnectError, before the first byte

    (a ``ClientConnectorError``, no connection made, is the ``TransportUnreachedError`` kind of
    ``TransportConnectError``).
        body      TransportError, after the first byte               TransportError, after the first byte

    Args:
        exc: the error caught (a ``TimeoutError`` or an ``aiohttp.ClientError``).
        stage: where it happened.
        worker_id: the worker.
        url: the URL requested.

    Returns:
        The error to raise ``from exc``.
    """
    if stage == "body":
        return TransportError(f"upstream body broke: {exc!r}", worker_id=worker_id, endpoint=url,
                              is_before_first_byte=False)
    if isinstance(exc, TimeoutError):
        if stage == "headers":
            message = f"worker {worker_id} timed out before the first byte"
        else:
            message = f"GET {url} timed out"
        return TransportTimeoutError(message, worker_id=worker_id, endpoint=url, is_before_first_byte=True)
    name = exc.__class__.__name__
    message = f"worker {worker_id} unreachable: {name}" if stage == "headers" else f"GET {url} failed: {name}"
    kind = TransportUnreachedError if isinstance(exc, aiohttp.ClientConnectorError) else TransportConnectError
    return kind(message, worker_id=worker_id, endpoint=url, is_before_first_byte=True)


def _json_or_none(body: bytes) -> object:
    if not body:
        return None
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None


def _body_timeout(total: _Deadline, worker_id: str, url: str) -> TransportTimeoutError | None:
    """The error for a body wait cancelled by its total deadline (``None``: another cancellation, to re-raise)."""
    if total.has_fired and total.task.uncancel() == 0:
        return TransportTimeoutError(f"worker {worker_id} exceeded the total timeout", worker_id=worker_id,
                                     endpoint=url, is_before_first_byte=False)
    return None


class _ChunkIterator:
    """Body chunks of an ``aiohttp.ClientResponse`` as they arrive (one ``readany`` per step, no generator frame)."""

    __slots__ = ("_content", "_worker_id", "_url", "_total")

    def __init__(self, resp: aiohttp.ClientResponse, worker_id: str, url: str, total: _Deadline) -> None:
        self._content = resp.content
        self._worker_id = worker_id
        self._url = url
        self._total = total

    def __aiter__(self) -> _ChunkIterator:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except EofStream:
            self._total.is_done = True
            raise StopAsyncIteration from None
        except asyncio.CancelledError:
            timeout = _body_timeout(self._total, self._worker_id, self._url)
            if timeout is None:
                raise
            raise timeout from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise map_aiohttp_error(exc, "body", self._worker_id, self._url) from exc
        if not chunk:
            self._total.is_done = True
            raise StopAsyncIteration
        return chunk


class _AiohttpResponse:
    """Adapts ``aiohttp.ClientResponse`` to ``UpstreamResponse``."""

    __slots__ = ("_resp", "status", "headers", "_worker_id", "_url", "_total")

    def __init__(self, resp: aiohttp.ClientResponse, worker_id: str, url: str, total: _Deadline) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers
        self._worker_id = worker_id
        self._url = url
        self._total = total

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return _ChunkIterator(self._resp, self._worker_id, self._url, self._total)

    async def read(self) -> bytes:
        try:
            body = await self._resp.read()
        except asyncio.CancelledError:
            timeout = _body_timeout(self._total, self._worker_id, self._url)
            if timeout is None:
                raise
            raise timeout from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise map_aiohttp_error(exc, "body", self._worker_id, self._url) from exc
        self._total.is_done = True
        return body

    def release(self) -> None:
        self._total.is_done = True
        if not self._resp.content.at_eof():
            self._resp.close()
        else:
            self._resp.release()


class _Deadline(msgspec.Struct, gc=False):
    """One request's deadline (for its response headers, or for its whole exchange).

    Attributes:
        task: the task running the request (cancelled when the deadline passes first).
        deadline_s: ``loop.time()`` at which it times out, seconds.
        is_done: what the deadline bounds has ended, however (nothing to cancel).
        has_fired: the deadline passed and ``task`` was cancelled for it.
    """

    task: asyncio.Task[object]
    deadline_s: float
    is_done: bool = False
    has_fired: bool = False


class Deadlines:
    """Every in-flight request's deadline of one kind (first byte, or total) on one loop timer.

    A per-request ``loop.call_at`` (plus its cancel) costs a timer handle per request; here a request only appends
    a deadline to a FIFO. With one timeout for all requests the FIFO is in deadline order, so one timer, set for
    the oldest pending deadline, fires each deadline exactly: on firing it pops every finished entry and cancels
    every expired one from the front, then re-arms for the new front. Finished entries are also popped from the
    front on every ``add``, so the FIFO holds the requests sent since the oldest one still running; behind a long
    one (a stream of many minutes) it is compacted (finished entries dropped, order kept) whenever it has doubled
    since the last compaction, which keeps it under twice the requests in flight plus ``MIN_COMPACT_LEN``.

    Args:
        loop: the event loop the requests run on.
        timeout_s: seconds from ``add`` to the deadline.

    Attributes:
        loop: the event loop the requests run on.
    """

    MIN_COMPACT_LEN = 4096
    """FIFO length below which it is never compacted."""

    __slots__ = ("loop", "_timeout_s", "_pending", "_timer", "_compact_len")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self._timeout_s = timeout_s
        self._pending: deque[_Deadline] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._compact_len = self.MIN_COMPACT_LEN

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, task: asyncio.Task[object]) -> _Deadline:
        """Start ``task``'s deadline; set ``is_done`` on the result once the wait ends, whatever the outcome."""
        pending = self._pending
        while pending and pending[0].is_done:
            pending.popleft()
        if len(pending) >= self._compact_len:
            pending = self._pending = deque([d for d in pending if not d.is_done])
            self._compact_len = max(self.MIN_COMPACT_LEN, 2 * len(pending))
        deadline = _Deadline(task, self.loop.time() + self._timeout_s)
        pending.append(deadline)
        if self._timer is None:
            self._timer = self.loop.call_at(deadline.deadline_s, self._fire)
        return deadline

    def _fire(self) -> None:
        self._timer = None
        pending = self._pending
        now_s = self.loop.time()
        while pending:
            head = pending[0]
            if not head.is_done:
                if head.deadline_s > now_s:
                    self._timer = self.loop.call_at(head.deadline_s, self._fire)
                    return
                head.is_done = head.has_fired = True
                head.task.cancel()
            pending.popleft()


class AiohttpTransport:
    """aiohttp client sessions, one per worker, each with a pooled keep-alive connector.

    Timeouts (``TimeoutsConfig``, seconds): ``connect_s`` bounds opening a connection (aiohttp's), ``first_byte_s``
    the wait for the response headers and ``total_s`` the whole exchange including a streamed body (both
    ``Deadlines``: see the module docstring).
    """

    def __init__(self, timeouts: TimeoutsConfig, *, limit_per_worker: int = 0) -> None:
        """Create an empty transport; sessions are opened lazily per worker.

        Args:
            timeouts: upstream timeouts.
            limit_per_worker: connection pool size per worker (0 = unbounded).
        """
        self._timeouts = timeouts
        self._limit = limit_per_worker
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._urls: dict[str, URL] = {}
        self._deadlines: Deadlines | None = None
        self._total_deadlines: Deadlines | None = None
        self._retired: set[aiohttp.ClientSession] = set()
        self._closing: set[asyncio.Task[None]] = set()
        # No total: aiohttp's would arm a timer per request and wrap every body wait; ``Deadlines`` enforce it.
        self._client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s)

    def _session(self, worker_id: str) -> aiohttp.ClientSession:
        session = self._sessions.get(worker_id)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=30.0, ttl_dns_cache=300)
            session = aiohttp.ClientSession(
                connector=connector, timeout=self._client_timeout, auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._sessions[worker_id] = session
        return session

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        url = request.base_url + request.path
        parsed_url = self._urls.get(url)
        if parsed_url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            parsed_url = self._urls[url] = URL(url)
        session = self._sessions.get(request.worker_id)  # a session leaves the dict when it is closed
        if session is None:
            session = self._session(request.worker_id)
        deadlines = self._deadlines
        totals = self._total_deadlines
        if deadlines is None or totals is None or deadlines.loop.is_closed():
            loop = asyncio.get_running_loop()
            deadlines = self._deadlines = Deadlines(loop, self._timeouts.first_byte_s)
            totals = self._total_deadlines = Deadlines(loop, self._timeouts.total_s)
        # The timeouts, as ``asyncio.timeout`` does them minus its per-use timer: on expiry a deadline cancels this
        # task, and the cancellations they caused (and only those) become a timeout.
        task = asyncio.current_task(deadlines.loop)
        assert task is not None
        total = totals.add(task)
        expiry = deadlines.add(task)
        try:
            try:
                # A worker's redirect is its answer, relayed as is: following it would resend (or, for 301-303,
                # drop) the completion's body.
                if request.skip_auto_headers:  # per request: a session-wide list costs a header copy every time
                    resp = await session.request(request.method, parsed_url, data=request.body,
                                                 headers=request.headers, skip_auto_headers=request.skip_auto_headers,
                                                 allow_redirects=False)
                else:
                    resp = await session.request(request.method, parsed_url, data=request.body, headers=request.headers,
                                                 allow_redirects=False)
            except asyncio.CancelledError:
                num_fired = expiry.has_fired + total.has_fired  # the cancellations the deadlines made
                if num_fired:
                    if num_fired == 2:
                        task.uncancel()
                    if task.uncancel() == 0:  # none left from elsewhere (e.g. the client going away)
                        raise TimeoutError from None
                raise
            finally:
                expiry.is_done = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            total.is_done = True
            raise map_aiohttp_error(exc, "headers", request.worker_id, url) from exc
        except BaseException:
            total.is_done = True
            raise
        return _AiohttpResponse(resp, request.worker_id, url, total)

    async def get_bytes(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, bytes]:
        """GET ``url`` on the worker's pool (health, load endpoints).

        Returns:
            ``(status, body)``.

        Raises:
            TransportError: connect error or timeout.
        """
        status, _, body = await self.get_with_headers(worker_id, url, timeout_s)
        return status, body

    async def get_with_headers(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
        """GET ``url`` on the worker's pool (snapshot endpoint: its headers matter).

        Returns:
            ``(status, headers with lower-cased names, body)``.

        Raises:
            TransportError: connect error or timeout.
        """
        session = self._session(worker_id)
        try:
            async with asyncio.timeout(timeout_s):
                async with session.get(url) as resp:
                    body = await resp.read()
                    return resp.status, {k.lower(): v for k, v in resp.headers.items()}, body
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise map_aiohttp_error(exc, "get", worker_id, url) from exc

    async def get_json(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, object]:
        """``get_bytes`` with the body decoded as JSON (``None`` when empty or not JSON)."""
        status, body = await self.get_bytes(worker_id, url, timeout_s)
        return status, _json_or_none(body)

    async def remove_worker(self, worker_id: str, *, is_idle: Callable[[], bool] | None = None) -> None:
        session = self._sessions.pop(worker_id, None)
        if session is None:
            return
        if is_idle is None or is_idle():
            await session.close()
            return
        self._retired.add(session)
        task = asyncio.get_running_loop().create_task(self._close_when_idle(session, is_idle))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_when_idle(self, session: aiohttp.ClientSession, is_idle: Callable[[], bool]) -> None:
        """Close a removed worker's pool once its requests ended (polled every 0.1 s), at most ``total_s`` on."""
        loop = asyncio.get_running_loop()
        end_s = loop.time() + self._timeouts.total_s
        while not is_idle() and loop.time() < end_s:
            await asyncio.sleep(0.1)
        self._retired.discard(session)
        await session.close()

    async def aclose(self) -> None:
        for task in list(self._closing):
            task.cancel()
        sessions, self._sessions = self._sessions, {}
        retired, self._retired = self._retired, set()
        for session in [*sessions.values(), *retired]:
            await session.close()


class MockResponse:
    """An in-memory ``UpstreamResponse``.

    Args:
        status: HTTP status.
        headers: response headers.
        chunks: body chunks yielded by ``iter_chunks``; an ``Exception`` instance in the list is raised at that
            point (a broken stream); an ``asyncio.Event`` is awaited (lets a test hold the stream open).
    """

    def __init__(
        self, status: int = 200, headers: Mapping[str, str] | None = None,
        chunks: Sequence[bytes | BaseException | asyncio.Event] = (),
    ) -> None:
        self.status = status
        self.headers: Mapping[str, str] = dict(headers or {})
        self._chunks = list(chunks)
        self.is_released = False
        self.is_fully_read = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for item in self._chunks:
            if isinstance(item, asyncio.Event):
                await item.wait()
            elif isinstance(item, BaseException):
                raise TransportError("mock body broke", worker_id="mock", endpoint="mock", is_before_first_byte=False)
            else:
                yield item
        self.is_fully_read = True

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    def release(self) -> None:
        self.is_released = True


MockHandler = Callable[[UpstreamRequest], Awaitable[MockResponse]]


class MockTransport:
    """Answers every request from ``handler`` in memory; records requests and responses for assertions.

    The handler may raise ``TransportConnectError`` / ``TransportTimeoutError`` to simulate a failure before the
    first byte.
    """

    def __init__(self, handler: MockHandler) -> None:
        self._handler = handler
        self.requests: list[UpstreamRequest] = []
        self.responses: list[MockResponse] = []
        self.is_closed = False

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.requests.append(request)
        resp = await self._handler(request)
        self.responses.append(resp)
        return resp

    async def get_bytes(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, bytes]:
        """Health/load GETs through the handler."""
        status, _, body = await self.get_with_headers(worker_id, url, timeout_s)
        return status, body

    async def get_with_headers(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
        """Snapshot GETs through the handler (headers with lower-cased names)."""
        resp = await self.send(UpstreamRequest(worker_id, "", "GET", url, (), b""))
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()

    async def get_json(self, worker_id: str, url: str, timeout_s: float) -> tuple[int, object]:
        """``get_bytes`` decoded as JSON."""
        status, body = await self.get_bytes(worker_id, url, timeout_s)
        return status, _json_or_none(body)

    async def remove_worker(self, worker_id: str, *, is_idle: Callable[[], bool] | None = None) -> None:
        return None

    async def aclose(self) -> None:
        self.is_closed = True
