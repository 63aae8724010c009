"""Session derivation for traces that carry no session ids (the Mooncake traces).

Rule (applied in arrival order):

1. The **shared head** is the longest run of ids that every request of the slice starts with (in
   ``conversation_trace.jsonl`` that is ``[0]``, a system prompt every request shares). Its length is ``h``
   blocks.
2. For each request, ``k`` is the number of leading ids it shares with some earlier request (the longest
   prefix that is a path in the trie of earlier requests; the ids are chained, so this equals "its first ``k``
   ids were all seen before").
3. If ``k > h`` the request **continues the session of the latest earlier request that shares those ``k``
   ids** (the one that last passed through its deepest matched block); otherwise it opens a new session.

So a request whose ids extend an earlier request's beyond the shared head continues that conversation, while
requests that share only the head do not fall into one giant session (which a key built from "the first
blocks" would give). Every id is keyed by its namespace, so traces with local ids never mix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from loadgen.traces import TraceRequest

logger = logging.getLogger(__name__)


def shared_head_length(requests: Sequence[TraceRequest]) -> int:
    """Length in blocks of the id run every request starts with (0 for an empty trace or mixed namespaces)."""
    if not requests:
        return 0
    first = requests[0]
    head = list(first.hash_ids)
    for r in requests[1:]:
        if r.namespace != first.namespace:
            return 0
        n = 0
        limit = min(len(head), len(r.hash_ids))
        while n < limit and head[n] == r.hash_ids[n]:
            n += 1
        del head[n:]
        if not head:
            return 0
    return len(head)


def derive_sessions(requests: Sequence[TraceRequest], *, prefix: str = "s") -> list[TraceRequest]:
    """Assign session ids by the chain rule of the module docstring.

    Args:
        requests: the trace slice in arrival order (existing ``session_id`` values are replaced).
        prefix: session ids are ``f"{prefix}{n}"`` with ``n`` counting sessions from 0 in order of first arrival.

    Returns:
        The same requests with ``session_id`` set.
    """
    head = shared_head_length(requests)
    # (namespace, block id) -> index of the latest request whose prefix passes through that block.
    last_through: dict[tuple[str, int], int] = {}
    session_of: list[str] = []
    out: list[TraceRequest] = []
    num_sessions = 0
    for i, r in enumerate(requests):
        k = 0
        ids = r.hash_ids
        while k < len(ids) and (r.namespace, ids[k]) in last_through:
            k += 1
        if k > head:
            session_id = session_of[last_through[(r.namespace, ids[k - 1])]]
        else:
            session_id = f"{prefix}{num_sessions}"
            num_sessions += 1
        session_of.append(session_id)
        for block_id in ids:
            last_through[(r.namespace, block_id)] = i
        out.append(msgspec.structs.replace(r, session_id=session_id))
    logger.info("derived %d sessions from %d requests (shared head %d blocks)", num_sessions, len(requests), head)
    return out
