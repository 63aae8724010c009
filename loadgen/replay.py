"""Replaying a trace against an OpenAI-compatible endpoint: open loop on timestamps, or closed loop by session.

* **Open loop**: request ``i`` is sent at ``(arrival_s[i] - start offset) / time_scale`` seconds after the start,
  whatever happened to earlier requests (the trace's own arrival process; bursts stay bursts). A cap on requests
  in flight protects the client machine; requests wait for a slot when it is full (their TTFT then includes
  that wait, as it would for a real client).
* **Closed loop**: ``concurrency`` session runners; each takes the next session (in order of first arrival)
  and sends its turns one after another, waiting ``think_time_s / time_scale`` before each turn after the first.
* **Deadline** (``max_duration_s``): every wait of the replay (an arrival time, a think time, a free slot) ends at
  the deadline, and no request is sent after it; requests already in flight run to completion (or to their
  ``request_timeout_s``), so the replay ends when the last of them does.

Every request of a session carries the session header (``x-session-id`` by default), its value the session id
with the run's ``session_prefix`` in front (``lg-3f9a0c1e-trace_0003/agent_001``); the records keep the same
prefixed id. A fresh prefix per run keeps a gateway's session ownership (sticky sessions outlive a run by their
idle timeout) from carrying over from an earlier run, or from another client's sessions of the same name.

Times in the records are wall-clock; the report multiplies them by ``time_scale`` so that, against sim workers
running ``time_scale`` times faster than real time, results read in simulated seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import aiohttp
import msgspec

from loadgen.client import (
    DEFAULT_PREDICTED_CACHED_HEADER,
    DEFAULT_WORKER_HEADER,
    CompletionRequest,
    RequestRecord,
    send_completion,
)
from loadgen.errors import ReplayError
from loadgen.prompts import PromptBuilder
from loadgen.traces import TraceRequest

logger = logging.getLogger(__name__)

SESSION_PREFIX_PATTERN = r"^[!-~]{0,64}$"
"""A session prefix: at most 64 visible ASCII characters (no space, no control character), so that the prefixed
id is a valid header value."""

SkipReason = Literal["max_duration_s"]
"""Why requests of a replay were not sent: ``"max_duration_s"``, the replay's wall-clock limit was reached."""


def new_session_prefix() -> str:
    """A fresh per-run session prefix: ``"lg-"``, 8 random hex digits (32 bits from ``secrets``) and ``"-"``,
    e.g. ``"lg-3f9a0c1e-"``."""
    return f"lg-{secrets.token_hex(4)}-"


def check_session_prefix(prefix: str) -> str:
    """Return ``prefix`` when it matches ``SESSION_PREFIX_PATTERN``.

    Raises:
        ReplayError: longer than 64 characters, or holding a space, a control or a non-ASCII character.
    """
    if re.fullmatch(SESSION_PREFIX_PATTERN, prefix) is None:
        raise ReplayError(f"session prefix must be at most 64 visible ASCII characters (no spaces), got {prefix!r}")
    return prefix


def request_max_tokens(request: TraceRequest, max_output_tokens: int | None) -> int:
    """The ``max_tokens`` a replay sends for ``request``: its recorded output length (at least 1), capped by
    ``max_output_tokens`` (``ReplayConfig.max_output_tokens``; ``None``: no cap)."""
    max_tokens = max(1, request.num_output_tokens)
    return max_tokens if max_output_tokens is None else min(max_tokens, max_output_tokens)


class ReplayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """How to replay a trace."""

    url: str
    """Base URL of the OpenAI-compatible endpoint (``http://127.0.0.1:8000``); ``/v1/completions`` is appended
    unless the URL already ends with it."""
    model: str = "sim"
    """``model`` field of every request."""
    mode: Literal["open", "closed"] = "open"
    """Open loop on timestamps, or closed loop by session."""
    time_scale: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    """Trace time runs this many times faster than wall time; reported times are multiplied by it."""
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 8
    """Closed loop: sessions in flight."""
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 256
    """Open loop: requests in flight at most."""
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Cap on ``max_tokens`` (the trace's output length otherwise)."""
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    """Wall-clock limit of one request, seconds."""
    max_duration_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    """Wall-clock limit of the replay, seconds: every wait ends at it and no request is sent after it (requests in
    flight finish)."""
    session_header: str = "x-session-id"
    """Request header carrying the session id."""
    worker_header: str = DEFAULT_WORKER_HEADER
    """Response header naming the serving worker."""
    predicted_cached_header: str = DEFAULT_PREDICTED_CACHED_HEADER
    """Response header with the gateway's predicted cached tokens."""
    metrics_url: str | None = None
    """A kvgate gateway's ``/metrics``: read before and after the run for its cached-token mismatches by cause
    (``kvgate_cached_tokens_mismatches_total``); ``None``: not read."""
    session_prefix: Annotated[str, msgspec.Meta(pattern=SESSION_PREFIX_PATTERN)] = ""
    """Put in front of every session id sent (the session header) and recorded (``RequestRecord.session_id``);
    empty: the trace's bare ids. ``kvgate loadgen`` sets a fresh one per run (``new_session_prefix``)."""

    def session_id(self, request: TraceRequest) -> str:
        """The session id sent for ``request``: ``session_prefix`` + its id (empty when it has none)."""
        return self.session_prefix + request.session_id if request.session_id else ""

    @property
    def completions_url(self) -> str:
        """The URL requests are posted to."""
        base = self.url.rstrip("/")
        if base.endswith("/v1/completions"):
            return base
        if base.endswith("/v1"):
            return base + "/completions"
        return base + "/v1/completions"


class ReplayResult(msgspec.Struct):
    """Outcome of one replay.

    Attributes:
        records: one per request sent, in trace order.
        duration_s: wall-clock seconds from the first send to the last completion.
        num_skipped: requests of the slice not sent.
        skip_reason: why they were not sent (``None`` when every request was sent).
    """

    records: list[RequestRecord]
    duration_s: float
    num_skipped: int = 0
    skip_reason: SkipReason | None = None


ProgressCallback = Callable[[RequestRecord], None]


class Replayer:
    """Runs one replay of ``requests`` with ``config``.

    Args:
        requests: the trace slice (arrival order).
        config: replay settings.
        prompts: builds each request's prompt text.
        on_complete: called after each request finishes (progress bars).

    Raises:
        ReplayError: nothing to replay, a URL that is not http(s), or a session prefix that is not a valid header
            value (``check_session_prefix``).
    """

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        config: ReplayConfig,
        prompts: PromptBuilder,
        on_complete: ProgressCallback | None = None,
    ) -> None:
        if not requests:
            raise ReplayError("the trace slice is empty")
        if not config.url.startswith(("http://", "https://")):
            raise ReplayError(f"url must start with http:// or https://, got {config.url!r}")
        check_session_prefix(config.session_prefix)
        self._requests = list(requests)
        self._config = config
        self._prompts = prompts
        self._on_complete = on_complete
        self._records: dict[int, RequestRecord] = {}
        self._t0 = 0.0

    def _remaining_s(self) -> float:
        """Wall seconds left before the deadline (``inf`` without ``max_duration_s``; <= 0 once past it)."""
        limit = self._config.max_duration_s
        return math.inf if limit is None else self._t0 + limit - time.perf_counter()

    def _is_past_deadline(self) -> bool:
        return self._remaining_s() <= 0

    async def _wait(self, delay_s: float) -> bool:
        """Sleep ``delay_s`` seconds, or only until the deadline when it comes first.

        Returns:
            True when the replay may send after the wait; False when the deadline ended it (or was already past).
        """
        remaining_s = self._remaining_s()
        if delay_s >= remaining_s:
            if remaining_s > 0:
                await asyncio.sleep(remaining_s)
            return False
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        return not self._is_past_deadline()

    async def _send(self, session: aiohttp.ClientSession, index: int) -> RequestRecord:
        cfg = self._config
        r = self._requests[index]
        max_tokens = request_max_tokens(r, cfg.max_output_tokens)
        session_id = cfg.session_id(r)
        headers = {cfg.session_header: session_id} if session_id else {}
        record = RequestRecord(
            index=index,
            session_id=session_id,
            start_s=time.perf_counter() - self._t0,
            num_prompt_tokens=r.num_prompt_tokens,
        )
        self._records[index] = record
        prompt = self._prompts.prompt(r)
        await send_completion(
            session,
            CompletionRequest(cfg.completions_url, cfg.model, prompt, max_tokens, headers),
            record,
            timeout_s=cfg.request_timeout_s,
            worker_header=cfg.worker_header,
            predicted_cached_header=cfg.predicted_cached_header,
        )
        if record.error_kind is not None:
            logger.debug("request %d failed: %s %s", index, record.error_kind, record.error_message)
        if self._on_complete is not None:
            self._on_complete(record)
        return record

    async def _open_loop(self, session: aiohttp.ClientSession) -> None:
        cfg = self._config
        slots = asyncio.Semaphore(cfg.max_in_flight)
        tasks: list[asyncio.Task[RequestRecord | None]] = []
        base_s = self._requests[0].arrival_s

        async def one(index: int) -> RequestRecord | None:
            async with slots:
                if self._is_past_deadline():  # the slot came free after the deadline: not sent
                    return None
                return await self._send(session, index)

        try:
            for index, r in enumerate(self._requests):
                delay_s = (r.arrival_s - base_s) / cfg.time_scale - (time.perf_counter() - self._t0)
                if not await self._wait(delay_s):
                    break
                tasks.append(asyncio.create_task(one(index)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _closed_loop(self, session: aiohttp.ClientSession) -> None:
        cfg = self._config
        sessions: dict[str, list[int]] = {}
        for index, r in enumerate(self._requests):
            sessions.setdefault(r.session_id or f"#{index}", []).append(index)
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for turns in sessions.values():
            queue.put_nowait(turns)

        async def runner() -> None:
            while not queue.empty():
                turns = queue.get_nowait()
                for n, index in enumerate(turns):
                    think_s = self._requests[index].think_time_s / cfg.time_scale if n else 0.0
                    if not await self._wait(think_s):
                        return
                    await self._send(session, index)

        runners = [asyncio.create_task(runner()) for _ in range(min(cfg.concurrency, len(sessions)))]
        try:
            await asyncio.gather(*runners)
        finally:
            for task in runners:
                task.cancel()
            await asyncio.gather(*runners, return_exceptions=True)

    async def run(self) -> ReplayResult:
        """Replay the slice; returns the records of every request sent and the number not sent.

        Raises:
            RuntimeError: requests were left unsent without a ``max_duration_s`` (a broken invariant: only the
                deadline stops a replay that is not cancelled).
        """
        cfg = self._config
        limit = cfg.max_in_flight if cfg.mode == "open" else cfg.concurrency
        connector = aiohttp.TCPConnector(limit=limit, force_close=False)
        self._t0 = time.perf_counter()
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:
                if cfg.mode == "open":
                    await self._open_loop(s)
                else:
                    await self._closed_loop(s)
        finally:
            duration_s = time.perf_counter() - self._t0
        records = [self._records[i] for i in sorted(self._records)]
        for rec in records:
            if rec.e2e_s == 0.0 and rec.error_kind is None:
                rec.error_kind = "cancelled"
                rec.error_message = "the replay stopped before the request finished"
        num_skipped = len(self._requests) - len(records)
        skip_reason: SkipReason | None = None
        if num_skipped:
            if cfg.max_duration_s is None:
                raise RuntimeError(f"{num_skipped} requests were not sent, yet the replay has no max_duration_s")
            skip_reason = "max_duration_s"
        return ReplayResult(records=records, duration_s=duration_s, num_skipped=num_skipped, skip_reason=skip_reason)
