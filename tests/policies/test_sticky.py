"""session_sticky: keep/move table, margins, key derivation, and the one-round-trip flow with the real store."""

from __future__ import annotations

import pytest
import xxhash
from multidict import CIMultiDict

from policies import (
    SessionStickyConfig,
    SessionStickyPolicy,
    build_policy,
    decode_policy_config,
    derive_session_key,
    resolve_sticky,
)
from policies.base import Decision
from router.sessions.memory import MemorySessionStore
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit


def sticky(**fields: object) -> SessionStickyPolicy:
    policy = build_policy(decode_policy_config({"name": "session_sticky", **fields}))
    assert isinstance(policy, SessionStickyPolicy)
    return policy


def two_workers(owner_fields=None, other_fields=None):
    return make_snapshot(
        make_worker("owner", **{"num_gpu_cached_tokens": 4096, **(owner_fields or {})}),
        make_worker("other", **(other_fields or {})),
    )


# (case, owner fields, other fields, owner id, is_new, expected worker, reason, detail)
CASES = [
    ("owner holds the prefix: kept", {}, {}, "owner", False, "owner", "sticky", ""),
    ("no owner yet: inner best", {}, {}, None, False, "owner", "sticky_new", ""),
    ("owner just claimed", {}, {}, "owner", True, "owner", "sticky_new", ""),
    ("owner unhealthy", {"is_healthy": False}, {}, "owner", False, "other", "sticky_moved", "owner_unhealthy"),
    ("owner draining", {"is_draining": True}, {}, "owner", False, "other", "sticky_moved", "owner_draining"),
    ("owner gone", {}, {}, "ghost", False, "owner", "sticky_moved", "owner_missing"),
    (
        "owner saturated",
        {"num_running_requests": 32},
        {},
        "owner",
        False,
        "other",
        "sticky_moved",
        "owner_excluded",
    ),
    (
        "owner lost its prefix, alternative holds it: 1.2 s costlier and 30x",
        {"num_gpu_cached_tokens": 0},
        {"num_gpu_cached_tokens": 32_000},
        "owner",
        False,
        "other",
        "sticky_moved",
        "owner_costlier",
    ),
    (
        "alternative holds more of the prompt and is cheaper: moves, nothing to recompute",
        {"num_gpu_cached_tokens": 0},
        {"num_gpu_cached_tokens": 4096},
        "owner",
        False,
        "other",
        "sticky_moved",
        "owner_costlier",
    ),
    (
        "owner holds the prefix behind a queue shorter than its recompute: kept",
        {"num_pending_prefill_tokens": 2000},
        {},
        "owner",
        False,
        "owner",
        "sticky",
        "",
    ),
]


@pytest.mark.parametrize(
    ("owner_fields", "other_fields", "owner_id", "is_new", "worker_id", "reason", "detail"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_keep_or_move(owner_fields, other_fields, owner_id, is_new, worker_id, reason, detail):
    policy = sticky(inner={"name": "cache_aware", "max_running_requests": 32})
    num_prompt_tokens = 32_768 if other_fields.get("num_gpu_cached_tokens") == 32_000 else 8192
    snapshot = two_workers(owner_fields, other_fields)
    view = make_view(num_prompt_tokens, session_key="sid:s1")
    inner = policy.select_inner(view, snapshot)
    decision = policy.resolve(owner_id, inner, snapshot, is_new=is_new, view=view)
    assert (decision.worker_id, decision.reason, decision.detail) == (worker_id, reason, detail)
    assert decision.ranking[0] == worker_id
    chosen = next(w for w in snapshot.workers if w.worker_id == worker_id)
    assert decision.predicted_cached_tokens == chosen.num_cached_tokens
    # select() with the owner in the snapshot gives the same answer (when not a fresh claim)
    if not is_new:
        in_snapshot = make_snapshot(*snapshot.workers, session_owner=owner_id)
        assert sticky(inner={"name": "cache_aware", "max_running_requests": 32}).select(view, in_snapshot) == decision


def test_kept_owner_is_first_then_inner_ranking():
    policy = sticky()
    snapshot = make_snapshot(
        make_worker("a", num_gpu_cached_tokens=2048),
        make_worker("b", num_gpu_cached_tokens=1024),
        make_worker("c", num_gpu_cached_tokens=512),
    )
    inner = policy.select_inner(make_view(4096, session_key="k"), snapshot)
    assert inner.ranking == ("a", "b", "c")
    decision = policy.resolve("c", inner, snapshot)
    assert (decision.worker_id, decision.ranking, decision.scores) == ("c", ("c", "a", "b"), inner.scores)


def margin_inner(owner_s: float, best_s: float) -> Decision:
    return Decision("best", "min_ttft", {"best": best_s, "owner": owner_s}, 0, ("best", "owner"))


@pytest.mark.parametrize(
    ("max_extra_ttft_s", "max_ttft_ratio", "owner_s", "best_s", "moves"),
    [
        (0.5, 2.0, 1.2, 0.6, False),  # +0.6 s but exactly 2x: the ratio is not exceeded
        (0.5, 2.0, 1.3, 0.6, True),  # +0.7 s and 2.17x: both exceeded
        (0.5, 2.0, 1.0, 0.6, False),  # +0.4 s
        (0.5, 2.0, 10.6, 10.0, False),  # +0.6 s but only 1.06x
        (0.5, None, 10.6, 10.0, True),  # ratio not checked
        (None, 2.0, 0.03, 0.01, True),  # absolute not checked
        (None, None, 100.0, 0.01, False),  # no margin: never moves on cost
    ],
)
def test_margins_must_all_be_exceeded(max_extra_ttft_s, max_ttft_ratio, owner_s, best_s, moves):
    config = SessionStickyConfig(max_extra_ttft_s=max_extra_ttft_s, max_ttft_ratio=max_ttft_ratio)
    snapshot = make_snapshot(make_worker("best"), make_worker("owner"))
    decision = resolve_sticky(config, "owner", margin_inner(owner_s, best_s), snapshot)
    assert decision.worker_id == ("best" if moves else "owner")
    assert decision.reason == ("sticky_moved" if moves else "sticky")


def test_margins_do_not_apply_to_baseline_scores():
    policy = sticky(inner={"name": "least_loaded"})
    assert not policy.applies_margins
    snapshot = make_snapshot(make_worker("a"), make_worker("b", num_running_requests=9))
    decision = policy.select(make_view(session_key="k"), make_snapshot(*snapshot.workers, session_owner="b"))
    assert (decision.worker_id, decision.reason) == ("b", "sticky")


def test_no_session_key_is_the_inner_decision_and_no_worker_passes_through():
    policy = sticky()
    snapshot = two_workers()
    assert policy.select(make_view(8192), snapshot) == policy.select_inner(make_view(8192), snapshot)
    dead = make_snapshot(make_worker("owner", is_healthy=False), session_owner="owner")
    decision = policy.select(make_view(session_key="k"), dead)
    assert (decision.worker_id, decision.reason) == (None, "no_healthy_worker")


@pytest.mark.parametrize(
    ("sources", "headers", "user", "opening", "key"),
    [
        (("x-session-id", "x-smg-routing-key", "user", "opening_blocks"), {"X-Session-Id": "abc"}, "u", 7, "sid:abc"),
        (("x-session-id", "x-smg-routing-key", "user"), {"X-SMG-Routing-Key": "r1"}, "u", None, "smg:r1"),
        (
            ("x-smg-routing-key", "x-session-id"),
            {"x-session-id": "abc", "x-smg-routing-key": "r1"},
            None,
            None,
            "smg:r1",
        ),
        (("x-session-id", "user"), {"x-session-id": ""}, "alice", None, "user:alice"),
        (("x-session-id", "opening_blocks"), {}, None, 0xABC, "open:0000000000000abc"),
        (("opening_blocks",), {}, None, -1, "open:ffffffffffffffff"),
        (("opening_blocks",), {}, None, b"\x01\xff", "open:01ff"),
        (("user",), {"x-session-id": "abc"}, None, 7, None),
        (("user",), {}, "x" * 300, None, "user#" + __import__("xxhash").xxh3_128_hexdigest(b"x" * 300)),
    ],
)
def test_derive_session_key(sources, headers, user, opening, key):
    assert derive_session_key(sources, CIMultiDict(headers), user, opening) == key


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b"caf\xc3\xa9", "sid:caf\u00e9"),  # valid UTF-8 is kept as is
        (b"caf\xe9", "sid#" + xxhash.xxh3_128_hexdigest("caf\udce9".encode("utf-8", "surrogatepass"))),
        (b"\xff\xfe", "sid#" + xxhash.xxh3_128_hexdigest(b"\xed\xb3\xbf\xed\xb3\xbe")),
        (b"\xff" * 300, "sid#" + xxhash.xxh3_128_hexdigest(b"\xed\xb3\xbf" * 300)),
        (b"a" * 300, "sid#" + xxhash.xxh3_128_hexdigest(b"a" * 300)),  # long valid keys: digest of the UTF-8
    ],
)
def test_derive_session_key_of_header_bytes(raw, key):
    """A header value as aiohttp decodes it (UTF-8, non-UTF-8 bytes as surrogates): every key is valid UTF-8, and
    the same bytes give the same key."""
    headers = CIMultiDict({"x-session-id": raw.decode("utf-8", "surrogateescape")})
    got = derive_session_key(("x-session-id",), headers)
    assert got == key
    assert got.encode("utf-8").decode("utf-8") == key
    assert derive_session_key(("x-session-id",), CIMultiDict(headers)) == key


async def test_one_round_trip_flow_with_the_memory_store():
    now = [0.0]
    store = MemorySessionStore(idle_timeout_s=60.0, clock=lambda: now[0])
    policy = sticky()

    async def route(snapshot, num_prompt_tokens=8192):
        view = make_view(num_prompt_tokens, session_key="sid:s1")
        inner = policy.select_inner(view, snapshot)
        entry = await store.claim_or_touch("sid:s1", inner.worker_id)
        decision = policy.resolve(entry.worker_id, inner, snapshot, is_new=entry.is_new)
        if decision.reason == "sticky_moved":
            assert await store.move("sid:s1", entry.worker_id, decision.worker_id)
        return decision

    first = await route(make_snapshot(make_worker("a"), make_worker("b")))
    assert (first.worker_id, first.reason) == ("a", "sticky_new")
    now[0] = 10.0  # b now holds more, but within the margin: stay on a
    second = await route(
        make_snapshot(make_worker("a", num_gpu_cached_tokens=4096), make_worker("b", num_gpu_cached_tokens=6144))
    )
    assert (second.worker_id, second.reason) == ("a", "sticky")
    now[0] = 20.0  # a dies: the session moves to b, which becomes the owner
    third = await route(make_snapshot(make_worker("a", is_healthy=False), make_worker("b")))
    assert (third.worker_id, third.reason, third.detail) == ("b", "sticky_moved", "owner_unhealthy")
    now[0] = 30.0  # a is back, b still owns it
    fourth = await route(
        make_snapshot(make_worker("a", num_gpu_cached_tokens=8192), make_worker("b", num_gpu_cached_tokens=6144))
    )
    assert (fourth.worker_id, fourth.reason) == ("b", "sticky")
    now[0] = 91.0  # idle past 60 s: expired, a fresh claim goes to the inner best
    fifth = await route(make_snapshot(make_worker("a", num_gpu_cached_tokens=8192), make_worker("b")))
    assert (fifth.worker_id, fifth.reason) == ("a", "sticky_new")
