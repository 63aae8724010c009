"""The chaos run's client: one streamed completion sent to a gateway replica, failed over to the next replica when
it is refused before its answer's first byte (as a client behind a load balancer would), until its deadline; what
it ended as is a ``RequestOutcome``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec


class RequestOutcome(msgspec.Struct):
    """What one client request ended as.

    Attributes:
        index: position in the slice.
        start_s: send time, seconds after the replay started.
        kind: ``"completed"``, ``"clean_error"`` (OpenAI-shaped), ``"unclean_error"`` (anything else) or
            ``"hung"`` (no end before the deadline).
        detail: the error's status and message, or empty.
        num_attempts: sends (one per replica tried).
        worker: the serving worker (``x-kvgate-worker``).
        num_predicted_cached_tokens: ``x-kvgate-predicted-cached-tokens``.
        num_cached_tokens: ``usage.prompt_tokens_details.cached_tokens``.
        e2e_s: send to end.
    """

    index: int
    start_s: float
    kind: str = "hung"
    detail: str = ""
    num_attempts: int = 0
    worker: str | None = None
    num_predicted_cached_tokens: int | None = None
    num_cached_tokens: int | None = None
    e2e_s: float = 0.0


def _is_openai_error(obj: object) -> bool:
    """Whether ``obj`` is an OpenAI-style error body: ``{"error": {"message": str, "type": str, ...}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    err = obj["error"]
    return isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


class _Retry(Exception):
    """The attempt failed before the answer's first byte: send to the other replica."""

    def __init__(self, message: str, *, is_cut: bool = False) -> None:
        super().__init__(message)
        self.is_cut = is_cut
        """A 200 whose stream ended before any data event (not a refused connection)."""


MAX_CUT_RETRIES = 2
"""Sends again after a 200 stream that ended before any data; then the request counts as an unclean error."""


async def _attempt(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                   out: RequestOutcome) -> None:
    got_data = False
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            out.worker = resp.headers.get("x-kvgate-worker")
            predicted = resp.headers.get("x-kvgate-predicted-cached-tokens")
            out.num_predicted_cached_tokens = int(predicted) if predicted is not None else None
            if resp.status != 200:
                raw = await resp.read()
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
                out.kind = "clean_error" if _is_openai_error(obj) else "unclean_error"
                out.detail = f"HTTP {resp.status}: {raw[:160]!r}"
                return
            async for raw_line in resp.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                got_data = True
                data = line[5:].strip()
                if data == b"[DONE]":
                    out.kind = "completed"
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    out.kind = "clean_error" if _is_openai_error(chunk) else "unclean_error"
                    out.detail = f"stream error: {str(chunk['error'])[:160]}"
                    return
                usage = chunk.get("usage") if isinstance(chunk, dict) else None
                if isinstance(usage, dict):
                    details = usage.get("prompt_tokens_details") or {}
                    out.num_cached_tokens = details.get("cached_tokens")
            if not got_data:
                raise _Retry("the stream ended before its first data event", is_cut=True)
            out.kind = "unclean_error"
            out.detail = "the stream ended without [DONE] or an error chunk"
    except aiohttp.ClientPayloadError as exc:
        if not got_data:
            raise _Retry(f"the stream broke before its first data event: {exc}", is_cut=True) from exc
        out.kind = "unclean_error"
        out.detail = f"truncated answer: {exc}"
    except aiohttp.ClientConnectionError as exc:  # refused, reset, disconnected (a replica stopping)
        if got_data:
            out.kind = "unclean_error"
            out.detail = f"connection lost mid-stream: {type(exc).__name__}: {exc}"[:200]
            return
        raise _Retry(f"{type(exc).__name__}: {exc}") from exc
    except aiohttp.ClientError as exc:
        out.kind = "unclean_error"
        out.detail = f"{type(exc).__name__}: {exc}"[:200]


async def send_with_failover(session: aiohttp.ClientSession, urls: Sequence[str], first: int,
                             body: dict[str, Any], headers: dict[str, str], out: RequestOutcome,
                             deadline_s: float) -> None:
    """Send to ``urls[first]``, failing over to the next replica on ``_Retry``, until done or ``deadline_s``."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            k = first
            num_cuts = 0
            while True:
                out.num_attempts += 1
                try:
                    await _attempt(session, urls[k % len(urls)], body, headers, out)
                    return
                except _Retry as exc:
                    out.detail = f"retried: {exc}"[:200]
                    num_cuts += exc.is_cut
                    if num_cuts > MAX_CUT_RETRIES:
                        out.kind = "unclean_error"
                        out.detail = f"{exc} ({out.num_attempts} attempts)"[:200]
                        return
                    k += 1
                    await asyncio.sleep(0.05)
    except TimeoutError:
        out.kind = "hung"
        out.detail = f"no end within {deadline_s} s ({out.detail})"
    finally:
        out.e2e_s = time.monotonic() - t0
