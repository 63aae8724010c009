"""``session_sticky``: keep a session on the worker that owns its KV state, wrapping any other policy.

The gateway drives it in one store round trip (``router/sessions/base.py``)::

    key   = derive_session_key(config.key_sources, headers, body_user, opening_hash)   # None: no session
    inner = policy.select_inner(view, snapshot)              # pure; the best worker for this request
    entry = await store.claim_or_touch(key, inner.worker_id) # owner (existing, or just claimed = inner best)
    decision = policy.resolve(entry.worker_id, inner, snapshot, is_new=entry.is_new)      # pure
    if decision.reason == "sticky_moved":
        await store.move(key, entry.worker_id, decision.worker_id)                       # compare-and-set

``select(view, snapshot)`` does the same in one call when the owner is already in ``Snapshot.session_owner``.

Rules of ``resolve`` (first match wins):

=====================================================  ==========  =============================
situation                                              worker      reason (detail)
=====================================================  ==========  =============================
inner policy found no candidate                        None        inner's reason
no owner, or the owner was just claimed (``is_new``)   inner best  sticky_new
owner not in the snapshot                              inner best  sticky_moved (owner_missing)
owner unhealthy                                        inner best  sticky_moved (owner_unhealthy)
owner draining                                         inner best  sticky_moved (owner_draining)
owner is the inner best                                owner       sticky
owner not in the inner ranking (e.g. saturated)        inner best  sticky_moved (owner_excluded)
the move pays for what it loses, and every margin        inner best  sticky_moved (owner_costlier)
otherwise                                              owner       sticky
=====================================================  ==========  =============================

"The move pays for what it loses" (``price_moves``, on by default) is the rule of ``policies/move_cost.py``: the
owner's extra estimated TTFT must exceed the recompute of the prefix it holds and the alternative lacks, and when
that recompute is not zero the owner must also be beyond the fleet's recent tail (the p99 of the estimated TTFT
of the requests it has served lately). Margins
(``max_extra_ttft_s``, ``max_ttft_ratio``; off by default) are further conditions. Both compare the inner policy's
scores, so they apply only when those are estimated TTFT seconds (inner ``cache_aware``); with a baseline inside,
only availability moves a session. Idle expiry is the store's (``sessions.idle_timeout_s`` in the gateway's
config).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import msgspec
import xxhash

from policies.base import Decision, Policy, RequestView, Snapshot
from policies.cache_aware import CacheAwarePolicy
from policies.config import CacheAwareConfig, KeySource, SessionStickyConfig
from policies.move_cost import SessionMoveCost
from policies.residents import SessionResidents
from policies.returning import ReturningSessions, return_probability

logger = logging.getLogger(__name__)

__all__ = ["SessionStickyPolicy", "derive_session_key", "resolve_sticky"]

MAX_SESSION_KEY_CHARS = 256
"""Longer client-supplied keys are replaced by their xxh3-128 hex digest (bounded store entries)."""

_HEADER_PREFIX: Mapping[str, str] = {"x-session-id": "sid", "x-smg-routing-key": "smg"}


def _is_utf8(value: str) -> bool:
    """``value`` encodes as UTF-8: it holds no lone surrogate (aiohttp decodes a header's non-UTF-8 bytes to
    ``U+DC80..U+DCFF`` with ``surrogateescape``)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bounded(prefix: str, value: str) -> str:
    """``prefix:value``; ``prefix#<xxh3_128 hex>`` when ``value`` exceeds ``MAX_SESSION_KEY_CHARS`` or is not
    valid UTF-8.

    The digest is of ``value.encode("utf-8", "surrogatepass")``: the UTF-8 bytes of a valid value, and an
    injective encoding of any other ``str``, so the same header bytes always give the same key and every key
    encodes as UTF-8 (the Redis store, ``/admin/sessions``).
    """
    if len(value) > MAX_SESSION_KEY_CHARS or not _is_utf8(value):
        return f"{prefix}#{xxhash.xxh3_128_hexdigest(value.encode('utf-8', 'surrogatepass'))}"
    return f"{prefix}:{value}"


def derive_session_key(
    key_sources: tuple[KeySource, ...],
    headers: Mapping[str, str],
    user: str | None = None,
    opening_hash: int | bytes | None = None,
) -> str | None:
    """The request's session key from the first source in ``key_sources`` that has a non-empty value.

    Keys are namespaced by source so two sources never collide: ``sid:<x-session-id>``,
    ``smg:<X-SMG-Routing-Key>``, ``user:<body user>``, ``open:<hex>``. A value over 256 characters, or one that is
    not valid UTF-8 (a header's non-UTF-8 bytes), becomes ``<prefix>#<xxh3-128 hex of its UTF-8 bytes>`` (lone
    surrogates encoded with ``surrogatepass``), so every key is valid UTF-8.

    Args:
        key_sources: the configured order (``SessionStickyConfig.key_sources``).
        headers: request headers; a case-insensitive mapping (aiohttp's ``CIMultiDictProxy``) or one with
            lower-cased names.
        user: the body's ``user`` field, if any.
        opening_hash: an identity of the conversation's opening, computed by the gateway: the chained block hash
            covering the system prompt and the first user message (an int is formatted as 16 hex digits, bytes
            as hex). It stays the same on every turn of a conversation, unlike the prompt's last block.

    Returns:
        The key, or ``None`` when no source has a value (the request is routed without a session).
    """
    for source in key_sources:
        if source == "user":
            if user:
                return _bounded("user", user)
        elif source == "opening_blocks":
            if isinstance(opening_hash, int):
                return f"open:{opening_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"
            if opening_hash:
                return f"open:{opening_hash.hex()}"
        else:
            value = headers.get(source)
            if value:
                return _bounded(_HEADER_PREFIX[source], value)
    return None


def resolve_sticky(
    config: SessionStickyConfig,
    owner_id: str | None,
    inner: Decision,
    snapshot: Snapshot,
    *,
    is_new: bool = False,
    applies_margins: bool = True,
    num_prompt_tokens: int | None = None,
    move_cost: SessionMoveCost | None = None,
) -> Decision:
    """Keep or move a session (the table in the module docstring). Pure but for ``move_cost``'s counters.

    Args:
        config: the margins.
        owner_id: the session's owner from the store, or ``None`` without an entry.
        inner: the inner policy's decision for this request over ``snapshot``.
        snapshot: the same snapshot ``inner`` was computed from.
        is_new: the store's ``SessionEntry.is_new`` (the owner was claimed by this request).
        applies_margins: the inner scores are TTFT seconds, so the cost rule and the margins apply.
        num_prompt_tokens: the request's prompt tokens (the move rule prices the prefix it would recompute).
        move_cost: the move rule (``policies/move_cost.py``); ``None`` (or no ``num_prompt_tokens``): margins only.

    Returns:
        The decision; ``ranking`` lists the kept owner first, then the inner ranking.
    """
    best_id = inner.worker_id
    if best_id is None:
        return inner
    if owner_id is None or (is_new and owner_id == best_id):
        return _relabel(inner, "sticky_new", "")
    owner = None
    for worker in snapshot.workers:
        if worker.worker_id == owner_id:
            owner = worker
            break
    if owner is None:
        return _relabel(inner, "sticky_moved", "owner_missing")
    if not owner.is_healthy:
        return _relabel(inner, "sticky_moved", "owner_unhealthy")
    if owner.is_draining:
        return _relabel(inner, "sticky_moved", "owner_draining")
    if owner_id == best_id:
        return _relabel(inner, "sticky", "")
    if owner_id not in inner.ranking:
        return _relabel(inner, "sticky_moved", "owner_excluded")
    if applies_margins:
        owner_s, best_s = inner.scores.get(owner_id), inner.scores.get(best_id)
        if move_cost is not None and num_prompt_tokens is not None and owner_s is not None and best_s is not None:
            best = next((w for w in snapshot.workers if w.worker_id == best_id), None)
            moves = best is not None and move_cost.moves(num_prompt_tokens, owner, best, owner_s, best_s)
            if moves and (config.max_extra_ttft_s is not None or config.max_ttft_ratio is not None):
                moves = _is_costlier(config, owner_s, best_s)
        else:
            moves = _is_costlier(config, owner_s, best_s)
        if moves:
            return _relabel(inner, "sticky_moved", "owner_costlier")
    return Decision(
        worker_id=owner_id,
        reason="sticky",
        scores=inner.scores,
        predicted_cached_tokens=owner.num_cached_tokens,
        ranking=(owner_id, *(w for w in inner.ranking if w != owner_id)),
    )


def _is_costlier(config: SessionStickyConfig, owner_score: float | None, best_score: float | None) -> bool:
    """True when the owner exceeds every configured margin over the best (``False`` with no margin set)."""
    if owner_score is None or best_score is None:
        return False
    if config.max_extra_ttft_s is None and config.max_ttft_ratio is None:
        return False
    if config.max_extra_ttft_s is not None and owner_score - best_score <= config.max_extra_ttft_s:
        return False
    return config.max_ttft_ratio is None or owner_score > best_score * config.max_ttft_ratio


def _relabel(decision: Decision, reason: str, detail: str) -> Decision:
    """``decision`` with another reason and detail."""
    return Decision(
        worker_id=decision.worker_id,
        reason=reason,
        scores=decision.scores,
        predicted_cached_tokens=decision.predicted_cached_tokens,
        ranking=decision.ranking,
        detail=detail,
    )


class SessionStickyPolicy:
    """Session stickiness around an inner policy (see the module docstring for the gateway's call sequence).

    Args:
        config: key sources, idle timeout, margins.
        inner: the wrapped policy, built from ``config.inner``.

    Attributes:
        inner: the wrapped policy.
        applies_margins: whether the cost rule and margins are checked (the inner policy scores in TTFT seconds).
        move_cost: the move rule with its window and session statistics (``None``: ``price_moves`` off, or an inner
            policy that does not score in seconds).
        residents: each session's owner and latest prompt tokens (the snapshot's ``num_resident_tokens``).
        returning: each session's owner, latest placement and gaps between turns (``WorkerState.returning_in_s``
            of a new session's request; ``None``: ``charge_returning_sessions`` off, or an inner policy that does
            not score in seconds).
    """

    name = "session_sticky"

    def __init__(self, config: SessionStickyConfig, inner: Policy) -> None:
        self.config = config
        self.inner = inner
        self.applies_margins = isinstance(config.inner, CacheAwareConfig)
        self.move_cost: SessionMoveCost | None = None
        self.residents = SessionResidents(config.resident_idle_s)
        self.returning: ReturningSessions | None = None
        if config.charge_returning_sessions and isinstance(inner, CacheAwarePolicy):
            self.returning = ReturningSessions(config.resident_idle_s, config.return_gap_window)
        if config.price_moves and isinstance(inner, CacheAwarePolicy):
            self.move_cost = SessionMoveCost(inner.cost_model, inner.speed_factor,
                                             tail_quantile=config.move_tail_quantile,
                                             tail_window=config.move_tail_window)

    def select_inner(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """The inner policy's decision over ``inner_inputs(view, snapshot)``: the worker to propose to
        ``claim_or_touch``."""
        return self.inner.select(*self.inner_inputs(view, snapshot))

    def inner_inputs(self, view: RequestView, snapshot: Snapshot) -> tuple[RequestView, Snapshot]:
        """What the inner policy decides over (the admin's cost terms are computed from the same); a session not
        placed yet is
        marked ``is_new_session`` for it, and, when no worker holds any of its prompt (a cold prefill, the same work
        wherever it goes), with ``returning`` each worker's sessions expected back and the chance that one returns
        (``policies/returning.py``), and the fleet's served tail that caps the charge (the move rule's
``SessionMoveCost.tail_s`` at the latest worker clock; no cap with ``price_moves`` off). A prompt whose head some
worker holds is left to the cost model alone: charging
        the head's holder for its many sessions sent new sessions away from the head (Mooncake slice: hit ratio
        0.981 of the ceiling against 0.998)."""
        if view.session_key is not None and view.session_key not in self.residents:
            view = msgspec.structs.replace(view, is_new_session=True)
            returning = self.returning
            if returning is not None and not any(w.num_cached_tokens for w in snapshot.workers):
                residents = self.residents
                back = returning.returning_in_s(snapshot.workers)
                probability = return_probability(residents.num_new_sessions, residents.num_returning_turns)
                if back and probability:
                    move_cost = self.move_cost
                    tail = math.inf if move_cost is None else move_cost.tail_s(
                        max(w.clock_s for w in snapshot.workers))
                    view = msgspec.structs.replace(view, session_return_probability=probability,
                                                   session_return_tail_s=tail)
                    snapshot = msgspec.structs.replace(snapshot, workers=tuple(
                        msgspec.structs.replace(w, returning_in_s=back[w.worker_id]) if w.worker_id in back else w
                        for w in snapshot.workers))
        return view, snapshot

    def resolve(
        self, owner_id: str | None, inner: Decision, snapshot: Snapshot, *, is_new: bool = False,
        view: RequestView | None = None,
    ) -> Decision:
        """``resolve_sticky`` with this policy's config and move rule (which needs ``view``'s prompt length); the
        chosen worker's estimate goes into the rule's window, with the decision time on that worker's clock."""
        move_cost = self.move_cost
        decision = resolve_sticky(
            self.config, owner_id, inner, snapshot, is_new=is_new, applies_margins=self.applies_margins,
            num_prompt_tokens=view.num_prompt_tokens if view is not None else None, move_cost=move_cost,
        )
        if decision.worker_id is not None:
            chosen = next((w for w in snapshot.workers if w.worker_id == decision.worker_id), None)
            if move_cost is not None:
                move_cost.observe(decision.scores.get(decision.worker_id),
                                  is_new=owner_id is None or (is_new and owner_id == inner.worker_id),
                                  clock_s=chosen.clock_s if chosen is not None else 0.0)
            if view is not None and view.session_key is not None:
                self.residents.place(view.session_key, decision.worker_id, view.num_prompt_tokens, snapshot.now_s)
                if self.returning is not None:
                    self.returning.place(view.session_key, decision.worker_id,
                                         chosen.clock_s if chosen is not None else snapshot.now_s, snapshot.now_s)
        return decision

    def forget_worker(self, worker_id: str) -> int:
        """Forget the sessions counted on ``worker_id`` (removed from the fleet) in ``residents`` and ``returning``;
        returns how many ``residents`` dropped."""
        if self.returning is not None:
            self.returning.forget_worker(worker_id)
        return self.residents.forget_worker(worker_id)

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Inner decision, then keep or move ``snapshot.session_owner``; without a session key, the inner one."""
        inner = self.select_inner(view, snapshot)
        if view.session_key is None:
            return inner
        return self.resolve(snapshot.session_owner, inner, snapshot, view=view)
