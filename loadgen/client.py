"""One streamed OpenAI completions request, timed token by token.

Wire format: OpenAI ``POST /v1/completions`` with ``stream: true`` and
``stream_options: {"include_usage": true}``: the response is Server-Sent Events, ``data: <json>`` lines, each a
``text_completion`` chunk with ``choices[0].text``, a final chunk with empty ``choices`` and ``usage``
(``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``), then ``data: [DONE]``
(OpenAI API reference, "Completions" and "Streaming"; vLLM and SGLang send the same).

Timing: TTFT is from sending the request to the first chunk carrying text; inter-token latencies (ITL) are the
gaps between later chunks carrying text, divided among the tokens of a chunk when a server packs several
(``completion_tokens`` over the number of text chunks); e2e is from sending to the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping

import aiohttp
import msgspec

logger = logging.getLogger(__name__)

ENGINE_TTFT_KEY = "engine_ttft_wall_s"
"""The usage chunk's key for the worker engine's part of the TTFT, wall seconds (``workers.server.ENGINE_TTFT_KEY``)."""

DEFAULT_WORKER_HEADER = "x-kvgate-worker"
DEFAULT_PREDICTED_CACHED_HEADER = "x-kvgate-predicted-cached-tokens"
REQUEST_ID_HEADER = "x-request-id"
"""The response header with the gateway's id of the request (kvgate's ``router.proxy.REQUEST_ID_HEADER``): the key of
its entry in ``/admin/decisions``."""


class RequestRecord(msgspec.Struct):
    """What happened to one replayed request. Times are wall-clock seconds (the report rescales them).

    Attributes:
        index: position of the request in the replayed trace.
        session_id: its session id as sent (with the replay's ``session_prefix``; empty when it has none).
        start_s: send time, seconds after the replay started.
        num_prompt_tokens: prompt tokens per the trace.
        num_reported_prompt_tokens: ``usage.prompt_tokens``, or ``None``.
        num_output_tokens: ``usage.completion_tokens`` (else the number of text chunks).
        num_cached_tokens: ``usage.prompt_tokens_details.cached_tokens``, or ``None`` when not reported.
        num_predicted_cached_tokens: the gateway's predicted cached tokens (response header), or ``None``.
        worker: the worker that served it (response header), or ``None``.
        ttft_s: time to first token, or ``None`` on failure / no text.
        engine_ttft_s: the worker's engine part of ``ttft_s`` (``engine_ttft_wall_s`` in a kvgate worker's usage
            chunk: from the request entering the engine to its first token), or ``None`` when not reported.
        e2e_s: send to end of stream (or to the failure).
        itl_s: inter-token latencies.
        error_kind: ``None`` on success, else ``"connect"``, ``"timeout"``, ``"http_<status>"``, ``"stream"``
            (malformed or truncated stream) or ``"no_usage"`` (stream ended without a usage chunk).
        error_message: a short description of the failure.
        request_id: the response's ``x-request-id`` (the gateway's id of the request), or ``None``.
    """

    index: int
    session_id: str
    start_s: float
    num_prompt_tokens: int
    num_reported_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    num_predicted_cached_tokens: int | None = None
    worker: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    engine_ttft_s: float | None = None
    itl_s: list[float] = msgspec.field(default_factory=list)
    error_kind: str | None = None
    error_message: str = ""
    request_id: str | None = None

    @property
    def is_ok(self) -> bool:
        """The request completed without error."""
        return self.error_kind is None


class CompletionRequest(msgspec.Struct, frozen=True):
    """What to send for one request.

    Attributes:
        url: the completions URL (``.../v1/completions``).
        model: ``model`` field.
        prompt: prompt text.
        max_tokens: ``max_tokens`` (output tokens to generate; ``ignore_eos`` makes it exact).
        headers: extra headers (``x-session-id``).
    """

    url: str
    model: str
    prompt: str
    max_tokens: int
    headers: Mapping[str, str] = msgspec.field(default_factory=dict)


def _parse_int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def send_completion(
    session: aiohttp.ClientSession,
    request: CompletionRequest,
    record: RequestRecord,
    *,
    timeout_s: float,
    worker_header: str = DEFAULT_WORKER_HEADER,
    predicted_cached_header: str = DEFAULT_PREDICTED_CACHED_HEADER,
) -> RequestRecord:
    """Send ``request``, stream the answer and fill ``record`` (never raises for request failures).

    Args:
        session: the client session (its connector bounds connections).
        request: what to send.
        record: filled in place and returned.
        timeout_s: limit for the whole exchange, seconds.
        worker_header: response header naming the serving worker.
        predicted_cached_header: response header with the gateway's predicted cached tokens.

    Returns:
        ``record``.
    """
    body = {
        "model": request.model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    text_chunk_times: list[float] = []
    usage: dict[str, object] | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(request.url, json=body, headers=dict(request.headers)) as resp:
                record.worker = resp.headers.get(worker_header)
                record.request_id = resp.headers.get(REQUEST_ID_HEADER)
                record.num_predicted_cached_tokens = _parse_int(resp.headers.get(predicted_cached_header))
                if resp.status != 200:
                    detail = (await resp.text())[:200]
                    record.error_kind = f"http_{resp.status}"
                    record.error_message = detail
                    record.e2e_s = time.perf_counter() - t0
                    return record
                is_done = False
                async for raw_line in resp.content:
                    line = raw_line.strip()
                    if not line or line.startswith(b":"):
                        continue
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        is_done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        record.error_kind = "stream"
                        record.error_message = f"bad SSE data: {data[:80]!r}"
                        break
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk:
                        record.error_kind = "stream"
                        record.error_message = str(chunk["error"])[:200]
                        break
                    choices = chunk.get("choices") or []
                    if choices and isinstance(choices[0], dict) and choices[0].get("text"):
                        text_chunk_times.append(time.perf_counter())
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                        engine_ttft = chunk.get(ENGINE_TTFT_KEY)
                        if isinstance(engine_ttft, int | float) and not isinstance(engine_ttft, bool):
                            record.engine_ttft_s = float(engine_ttft)
                if record.error_kind is None and not is_done:
                    record.error_kind = "stream"
                    record.error_message = "stream ended without [DONE]"
    except TimeoutError:
        record.error_kind = "timeout"
        record.error_message = f"no complete answer within {timeout_s} s"
    except aiohttp.ClientConnectorError as exc:
        record.error_kind = "connect"
        record.error_message = str(exc)[:200]
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        record.error_kind = "stream"
        record.error_message = f"{type(exc).__name__}: {exc}"[:200]
    except aiohttp.ClientError as exc:
        record.error_kind = "client"
        record.error_message = f"{type(exc).__name__}: {exc}"[:200]
    record.e2e_s = time.perf_counter() - t0
    if text_chunk_times:
        record.ttft_s = text_chunk_times[0] - t0
    if usage is not None:
        record.num_reported_prompt_tokens = _parse_int(str(usage.get("prompt_tokens")))
        record.num_output_tokens = _parse_int(str(usage.get("completion_tokens"))) or 0
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            record.num_cached_tokens = _parse_int(str(details.get("cached_tokens")))
    else:
        record.num_output_tokens = len(text_chunk_times)
        if record.error_kind is None:
            record.error_kind = "no_usage"
            record.error_message = "stream ended without a usage chunk (stream_options.include_usage)"
    if len(text_chunk_times) > 1:
        tokens_per_chunk = max(1.0, record.num_output_tokens / len(text_chunk_times))
        record.itl_s = [
            (b - a) / tokens_per_chunk for a, b in zip(text_chunk_times, text_chunk_times[1:], strict=False)
        ]
    return record
