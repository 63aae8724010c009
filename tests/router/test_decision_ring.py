"""``router.decisions.DecisionRing``: the latest decisions kept as one msgpack buffer each, read back as equal
records (the policy object itself beside them), oldest dropped past ``maxlen``; what a record leaves allocated is
its buffer and its slot, not the values it was built from."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from policies import CacheAwarePolicy
from policies.base import RequestView, Snapshot, WorkerState
from policies.config import CacheAwareConfig
from router import decisions
from router.decisions import DecisionRecord, DecisionRing, PDRecord


def _record(i: int, policy: object) -> DecisionRecord:
    workers = tuple(
        WorkerState(f"w{k}", num_gpu_cached_tokens=16 * i + k, kv_usage=0.25 + k / 8, num_running_requests=k,
                    pending_prefills=((1.5 + i, 32 * k, 1024 * k + i),), clock_s=100.0 + i)
        for k in range(3))
    return DecisionRecord(
        f"req-{i}", "m", "w1", "min_ttft", "", f"s-{i}", 1000 + i, 64, {"w0": 0.5 + i, "w1": 0.25, "w2": 1e-3},
        {"w0": 0, "w1": 64, "w2": 16}, 2.5e-5, 40.0 + i,
        RequestView(f"req-{i}", "m", 1000 + i, 16, 16, f"s-{i}", 48, i % 2 == 0), Snapshot(workers, "w1", 40.0 + i),
        policy)


def _pd(i: int) -> PDRecord:
    return PDRecord(f"pd-{i}", "m", "vllm", "p0", "d1", "min_ttft", "min_load", {"p0": 0.125}, {"d1": 0.5, "d0": 2.0},
                    {"d1": True, "d0": False}, {"p0": 48}, 7, 1 << 20, 0.004, 700, None, 1e-4, 41.0 + i,
                    reported_cached_tokens=48, prefill_served_by="p0", decode_served_by="d1", outcome="ok")


def test_records_read_back_equal_with_their_policy_and_the_oldest_goes_past_maxlen() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig())
    ring = DecisionRing(4)
    built = [_record(0, policy), _pd(1), _record(2, policy), _record(3, policy), _pd(4), _record(5, policy)]
    for record in built:
        ring.append(record)
    assert len(ring) == 4 and ring.maxlen == 4
    assert list(ring) == built[2:]
    assert ring[-1] == built[5] and ring[-1].policy is policy and ring[1] == built[3]
    assert ring.latest(2) == built[4:] and ring.latest(10) == built[2:] and ring.latest(0) == []
    newest = ring[-1]
    assert isinstance(newest, DecisionRecord) and newest.snapshot is not None
    assert newest.snapshot.workers[2].pending_prefills == ((6.5, 64, 2053),)
    assert newest.scores == {"w0": 5.5, "w1": 0.25, "w2": 1e-3}
    # The decoded record answers the admin's cost terms as the built one does.
    assert newest.cost_terms() == built[5].cost_terms() and set(newest.cost_terms()) == {"w0", "w1", "w2"}


def test_a_kept_record_holds_two_allocations_not_its_values() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig())
    ring = DecisionRing(256)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(256):
            ring.append(_record(i, policy))  # each built record (some 40 values) is freed once appended
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # Only the gateway's own code counts: in a whole test run, other libraries' lazy caches (hypothesis's, say)
    # can allocate while this test runs.
    router_dir = str(Path(decisions.__file__).parent)
    grown = {str(s.traceback).rsplit("/", 1)[-1]: s.count_diff for s in after.compare_to(before, "lineno")
             if s.count_diff > 0 and s.traceback[0].filename.startswith(router_dir)}
    # One (kind, policy, buffer) tuple and one buffer a record, all at ``append``'s line, and the deque's 4 blocks
    # (of 64 slots) past its first.
    assert len(grown) == 1 and list(grown.values()) == [2 * 256 + 4]
    assert next(iter(grown)).startswith("decisions.py:")


def test_answers_are_kept_for_the_latest_maxlen_requests() -> None:
    ring = DecisionRing(2)
    ring.settle("r0", "w0", 64, "ok")
    ring.settle("r1", None, None, "NoWorkerError")
    assert ring.answer("r0") == {"served_by": "w0", "reported_cached_tokens": 64, "outcome": "ok"}
    ring.settle("r2", "w1", 0, "status_503")
    assert ring.answer("r0") is None  # the oldest went
    assert ring.answer("r1") == {"served_by": None, "reported_cached_tokens": None, "outcome": "NoWorkerError"}
    assert ring.answer("r2") == {"served_by": "w1", "reported_cached_tokens": 0, "outcome": "status_503"}
    assert ring.answer("r9") is None
