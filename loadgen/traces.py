"""Trace requests and the readers for the trace formats kvgate replays.

A trace is a list of ``TraceRequest`` in arrival order. Each request names its prompt as a chain of block ids
(``hash_ids``): equal ids at the same position mean an equal prefix, so a replay can rebuild prompts that share
exactly the prefixes the trace shares (see ``loadgen.prompts``).

Formats:

* **Mooncake FAST'25** (``conversation_trace.jsonl``): JSON Lines, one request per line,
  ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``; blocks of 512
  tokens, ``len(hash_ids) == ceil(input_length / 512)``, ids chained and global to the file. No session ids:
  sessions are derived from the chain (``loadgen.sessions``). Format as documented in the Mooncake repository,
  ``FAST25-release/`` (kvcache-ai/Mooncake).
* **Agentic coding sessions** (kv-cache-tester ``trace_*.json``): one JSON object per session,
  ``{"id", "block_size": 64, "hash_id_scope": "local", "requests": [...]}``; each request
  ``{"t": s, "in": tokens, "out": tokens, "hash_ids": [...], "think_time": s, ...}``; an entry with
  ``"type": "subagent"`` carries its own ``requests`` whose ``t`` counts from the sub-agent's start. Ids are
  local to the file, so each file is its own namespace; a sub-agent is its own session in the same namespace.
  Format as documented in callanjfox/kv-cache-tester, ``traces/``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from loadgen.errors import TraceError

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake FAST'25 traces."""


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace.

    Attributes:
        arrival_s: arrival time in seconds from the trace's start (open-loop replay).
        num_prompt_tokens: prompt length in tokens.
        num_output_tokens: output length in tokens, as recorded.
        hash_ids: one id per ``block_size`` tokens of the prompt (the last block may be partial); chained, so an
            id identifies the whole prefix up to and including its block.
        block_size: tokens per id.
        namespace: scope of the ids (ids are only comparable inside one namespace).
        session_id: the session the request belongs to (recorded or derived).
        think_time_s: pause before this request after the previous turn of its session finished (closed loop).
    """

    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...]
    block_size: int
    namespace: str = ""
    session_id: str = ""
    think_time_s: float = 0.0


def _require_int(value: Any, name: str, path: str, line_number: int | None, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{name} must be an integer >= {minimum}, got {value!r}", path=path, line_number=line_number)
    return value


def _require_number(value: Any, name: str, path: str, line_number: int | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{name} must be a finite number >= 0, got {value!r}", path=path, line_number=line_number)
    return float(value)


def _require_ids(value: Any, num_tokens: int, block_size: int, path: str, line_number: int | None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TraceError("hash_ids must be a list of integers", path=path, line_number=line_number)
    expected = math.ceil(num_tokens / block_size)
    if abs(len(value) - expected) > 1:
        raise TraceError(
            f"{len(value)} hash_ids for {num_tokens} tokens, expected about {expected} blocks of {block_size}",
            path=path,
            line_number=line_number,
        )
    return tuple(value)


def read_mooncake(
    path: str | Path,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> list[TraceRequest]:
    """Read a Mooncake FAST'25 JSONL trace, or a slice of it.

    Sessions are not assigned here (``session_id`` is empty); call ``loadgen.sessions.derive_sessions``.

    Args:
        path: the ``.jsonl`` file.
        start_s: skip requests that arrive before this time (seconds from the trace's first timestamp).
        duration_s: keep requests arriving within this many seconds after ``start_s`` (``None``: all).
        max_requests: keep at most this many requests (``None``: all).
        block_size: tokens per hash id (512 for the FAST'25 files).

    Returns:
        The requests in file order, ``arrival_s`` measured from the first request of the slice.

    Raises:
        TraceError: the file cannot be read, a line is not JSON, a field is missing or out of range, or the
            timestamps go backwards.
    """
    name = str(path)
    requests: list[TraceRequest] = []
    first_ms: float | None = None
    last_ms = -math.inf
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot open: {exc.strerror}", path=name) from exc
    with handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"not JSON: {exc.msg}", path=name, line_number=line_number) from exc
            if not isinstance(obj, dict):
                raise TraceError("each line must be a JSON object", path=name, line_number=line_number)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in obj:
                    raise TraceError(f"missing field {key!r}", path=name, line_number=line_number)
            timestamp_ms = _require_number(obj["timestamp"], "timestamp", name, line_number)
            if timestamp_ms < last_ms:
                raise TraceError("timestamps must not go backwards", path=name, line_number=line_number)
            last_ms = timestamp_ms
            if first_ms is None:
                first_ms = timestamp_ms
            t_s = (timestamp_ms - first_ms) / 1000.0
            if t_s < start_s:
                continue
            if duration_s is not None and t_s > start_s + duration_s:
                break
            num_prompt_tokens = _require_int(obj["input_length"], "input_length", name, line_number, 1)
            num_output_tokens = _require_int(obj["output_length"], "output_length", name, line_number, 0)
            hash_ids = _require_ids(obj["hash_ids"], num_prompt_tokens, block_size, name, line_number)
            requests.append(
                TraceRequest(
                    arrival_s=t_s - start_s,
                    num_prompt_tokens=num_prompt_tokens,
                    num_output_tokens=num_output_tokens,
                    hash_ids=hash_ids,
                    block_size=block_size,
                )
            )
            if max_requests is not None and len(requests) >= max_requests:
                break
    if requests:
        offset = requests[0].arrival_s
        requests = [msgspec.structs.replace(r, arrival_s=r.arrival_s - offset) for r in requests]
    logger.info("read %d requests from %s", len(requests), name)
    return requests


MOONCAKE_BUCKET_S = 3.0
"""The conversation trace's timestamps are bucketed at about this many seconds (traces README)."""


def spread_buckets(requests: Sequence[TraceRequest], bucket_s: float = MOONCAKE_BUCKET_S) -> list[TraceRequest]:
    """Spread the requests that share one timestamp evenly over the gap to the next timestamp (at most
    ``bucket_s``), in file order.

    The Mooncake conversation trace records arrivals bucketed at about 3 s (up to 28 requests share one
    timestamp); replayed as is, each bucket is one burst. Request ``j`` of ``k`` sharing timestamp ``t`` arrives
    at ``t + j * gap / k``: the order, the per-bucket counts and the mean rate stay; the last bucket uses
    ``bucket_s``.

    Args:
        requests: in arrival order.
        bucket_s: the trace's bucket width, seconds (> 0).

    Returns:
        The requests with new ``arrival_s``.

    Raises:
        ValueError: ``bucket_s`` is not positive.
    """
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be positive, got {bucket_s}")
    out: list[TraceRequest] = []
    i = 0
    while i < len(requests):
        t = requests[i].arrival_s
        j = i
        while j < len(requests) and requests[j].arrival_s == t:
            j += 1
        gap = min(bucket_s, requests[j].arrival_s - t) if j < len(requests) else bucket_s
        k = j - i
        out.extend(
            msgspec.structs.replace(r, arrival_s=t + n * gap / k) for n, r in enumerate(requests[i:j])
        )
        i = j
    return out


def _agentic_requests(
    entries: Sequence[Any],
    *,
    base_s: float,
    namespace: str,
    session_id: str,
    block_size: int,
    path: str,
    out: list[TraceRequest],
) -> None:
    """Append the requests of one session (and, recursively, its sub-agents as their own sessions)."""
    for index, entry in enumerate(entries):
        where = f"requests[{index}] of {session_id}"
        if not isinstance(entry, dict):
            raise TraceError(f"{where} is not an object", path=path)
        t_s = _require_number(entry.get("t", 0.0), f"{where}.t", path, None)
        if entry.get("type") == "subagent":
            sub_entries = entry.get("requests")
            if not isinstance(sub_entries, list):
                raise TraceError(f"{where}: sub-agent without a requests list", path=path)
            agent_id = str(entry.get("agent_id", f"agent{index}"))
            _agentic_requests(
                sub_entries,
                base_s=base_s + t_s,
                namespace=namespace,
                session_id=f"{session_id}/{agent_id}",
                block_size=block_size,
                path=path,
                out=out,
            )
            continue
        for key in ("in", "out", "hash_ids"):
            if key not in entry:
                raise TraceError(f"{where}: missing field {key!r}", path=path)
        num_prompt_tokens = _require_int(entry["in"], f"{where}.in", path, None, 1)
        num_output_tokens = _require_int(entry["out"], f"{where}.out", path, None, 0)
        hash_ids = _require_ids(entry["hash_ids"], num_prompt_tokens, block_size, path, None)
        think_time_s = _require_number(entry.get("think_time", 0.0) or 0.0, f"{where}.think_time", path, None)
        out.append(
            TraceRequest(
                arrival_s=base_s + t_s,
                num_prompt_tokens=num_prompt_tokens,
                num_output_tokens=num_output_tokens,
                hash_ids=hash_ids,
                block_size=block_size,
                namespace=namespace,
                session_id=session_id,
                think_time_s=think_time_s,
            )
        )


def read_agentic_session(path: str | Path) -> list[TraceRequest]:
    """Read one kv-cache-tester agentic session file.

    Args:
        path: a ``trace_*.json`` file.

    Returns:
        Its requests (the session's and every sub-agent's), sorted by arrival; the namespace and session id are
        the file's ``id`` (a sub-agent's session id is ``"<id>/<agent_id>"``).

    Raises:
        TraceError: unreadable file, bad JSON, or a malformed field.
    """
    name = str(path)
    try:
        with open(path, encoding="utf-8") as handle:
            obj = json.load(handle)
    except OSError as exc:
        raise TraceError(f"cannot open: {exc.strerror}", path=name) from exc
    except json.JSONDecodeError as exc:
        raise TraceError(f"not JSON: {exc.msg} (line {exc.lineno})", path=name) from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
        raise TraceError("expected an object with a 'requests' list", path=name)
    block_size = _require_int(obj.get("block_size", 64), "block_size", name, None, 1)
    session_id = str(obj.get("id") or Path(path).stem)
    out: list[TraceRequest] = []
    _agentic_requests(
        obj["requests"],
        base_s=0.0,
        namespace=session_id,
        session_id=session_id,
        block_size=block_size,
        path=name,
        out=out,
    )
    out.sort(key=lambda r: r.arrival_s)
    return out


def read_agentic_sessions(
    paths: Iterable[str | Path], *, session_stagger_s: float = 0.0, max_requests_per_session: int | None = None
) -> list[TraceRequest]:
    """Read several agentic session files into one trace.

    Args:
        paths: ``trace_*.json`` files (a directory is expanded to its ``*.json`` files in name order).
        session_stagger_s: the ``i``-th file's session starts ``i * session_stagger_s`` seconds after the first
            (the files all start at 0).
        max_requests_per_session: keep only each session's first requests (``None``: all).

    Returns:
        All requests sorted by arrival.

    Raises:
        TraceError: as ``read_agentic_session``, or when no file is found.
    """
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    if not files:
        raise TraceError("no session files found", path=", ".join(str(p) for p in paths))
    merged: list[TraceRequest] = []
    for i, file in enumerate(files):
        session = read_agentic_session(file)
        per_session: dict[str, int] = {}
        for r in session:
            n = per_session.get(r.session_id, 0)
            if max_requests_per_session is not None and n >= max_requests_per_session:
                continue
            per_session[r.session_id] = n + 1
            merged.append(msgspec.structs.replace(r, arrival_s=r.arrival_s + i * session_stagger_s))
    merged.sort(key=lambda r: r.arrival_s)
    return merged


def detect_format(path: str | Path) -> str:
    """``"mooncake"`` for a JSONL file, ``"agentic"`` for a ``.json`` file or a directory of them.

    Raises:
        TraceError: the path does not exist or has another suffix.
    """
    p = Path(path)
    if p.is_dir():
        return "agentic"
    if not p.exists():
        raise TraceError("no such file", path=str(p))
    if p.suffix == ".jsonl":
        return "mooncake"
    if p.suffix == ".json":
        return "agentic"
    raise TraceError("unknown trace format (expected .jsonl or .json, or a directory)", path=str(p))
