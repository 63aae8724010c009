"""consistent_hash: exact ring ownership, stability under add/remove, unhealthy fallback."""

from __future__ import annotations

import pytest
import xxhash

from policies import Policy, build_policy, decode_policy_config
from policies.consistent_hash import HashRing, key_hash
from tests.policies.builders import make_fleet, make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit


def build(num_virtual_nodes: int = 160) -> Policy:
    return build_policy(decode_policy_config({"name": "consistent_hash", "num_virtual_nodes": num_virtual_nodes}))


def brute_force_owner(key: str, worker_ids: list[str], num_virtual_nodes: int) -> str:
    """Reference: the point with the smallest hash greater than the key's, wrapping to the smallest point."""
    position = xxhash.xxh3_64_intdigest(key.encode())
    points = [(xxhash.xxh3_64_intdigest(f"{w}#{i}".encode()), w) for w in worker_ids for i in range(num_virtual_nodes)]
    after = [p for p in points if p[0] > position]
    return min(after)[1] if after else min(points)[1]


def owners(policy, workers, keys):
    snapshot = make_snapshot(*workers)
    return {key: policy.select(make_view(session_key=key), snapshot).worker_id for key in keys}


def test_owner_matches_reference_ring():
    workers = make_fleet(5)
    policy = build(num_virtual_nodes=8)
    got = owners(policy, workers, [f"sid:{i}" for i in range(200)])
    ids = [w.worker_id for w in workers]
    assert got == {key: brute_force_owner(key, ids, 8) for key in got}


def test_key_hash_is_xxh3_of_utf8():
    assert key_hash("sid:é") == xxhash.xxh3_64_intdigest("sid:é".encode())


def test_removing_one_of_ten_moves_only_its_keys():
    keys = [f"sid:{i}" for i in range(5000)]
    workers = make_fleet(10)
    policy = build()
    before = owners(policy, workers, keys)
    after = owners(policy, workers[:3] + workers[4:], keys)
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "w3" for k in moved)
    assert [k for k in keys if before[k] == "w3"] == moved
    assert 0.05 < len(moved) / len(keys) < 0.15


def test_adding_an_eleventh_moves_about_one_in_eleven_keys_to_it():
    keys = [f"sid:{i}" for i in range(5000)]
    workers = make_fleet(10)
    policy = build()
    before = owners(policy, workers, keys)
    after = owners(policy, (*workers, make_worker("w10")), keys)
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "w10" for k in moved)
    assert 0.05 < len(moved) / len(keys) < 0.13


def test_ring_depends_on_the_set_of_ids_not_their_order():
    keys = [f"sid:{i}" for i in range(300)]
    workers = make_fleet(6)
    assert owners(build(), workers, keys) == owners(build(), tuple(reversed(workers)), keys)


def test_unhealthy_owner_falls_to_successor_and_key_returns_on_recovery():
    policy = build()
    workers = make_fleet(4)
    view = make_view(session_key="sid:conversation-42")
    healthy = policy.select(view, make_snapshot(*workers))
    owner = healthy.worker_id
    assert healthy.reason == "consistent_hash"
    assert sorted(healthy.ranking) == ["w0", "w1", "w2", "w3"]
    sick = tuple(w if w.worker_id != owner else make_worker(owner, is_healthy=False) for w in workers)
    fallback = policy.select(view, make_snapshot(*sick))
    assert fallback.worker_id == healthy.ranking[1]
    assert fallback.ranking == healthy.ranking[1:]
    assert policy.select(view, make_snapshot(*workers)).worker_id == owner


def test_no_session_key_falls_back_to_least_loaded():
    snapshot = make_snapshot(make_worker("w0", num_running_requests=2), make_worker("w1", num_running_requests=1))
    decision = build().select(make_view(session_key=None), snapshot)
    assert (decision.worker_id, decision.reason, decision.ranking) == ("w1", "no_session_key", ("w1", "w0"))


def test_hash_ring_rejects_zero_virtual_nodes():
    with pytest.raises(ValueError, match="num_virtual_nodes"):
        HashRing(("w0",), 0)


def test_ranking_is_four_ring_successors_then_configuration_order():
    workers = make_fleet(8)
    ids = [w.worker_id for w in workers]
    decision = build(num_virtual_nodes=4).select(make_view(session_key="sid:x"), make_snapshot(*workers))
    # reference ring walk: distinct owners clockwise from the key
    position = xxhash.xxh3_64_intdigest(b"sid:x")
    points = sorted((xxhash.xxh3_64_intdigest(f"{w}#{i}".encode()), w) for w in ids for i in range(4))
    clockwise = [w for p, w in points if p > position] + [w for p, w in points if p <= position]
    successors = list(dict.fromkeys(clockwise))[:4]
    assert decision.ranking == (*successors, *(w for w in ids if w not in successors))
