"""The snapshot splice of one worker (``router.index.recovery``): which live batches are held, dropped and applied
around a snapshot's last seq, exactly."""

from __future__ import annotations

import pytest

from events.types import EventBatch
from router.index.recovery import Admitted, SnapshotSplice, Spliced


def batch(seq: int) -> EventBatch:
    return EventBatch(worker_id="w0", dp_rank=0, seq=seq, ts_s=float(seq), events=())


def seqs(batches: tuple[EventBatch, ...]) -> list[int]:
    return [b.seq for b in batches]


def holding(**limits: int) -> SnapshotSplice:
    splice = SnapshotSplice("w0", splices=True, **limits)
    splice.begin()
    return splice


def test_batches_are_held_while_the_snapshot_is_fetched():
    splice = holding()
    for seq in (3, 4, 5, 6):
        assert splice.admit(batch(seq)) == Admitted((), False, "none")
    assert splice.held is not None and seqs(tuple(splice.held)) == [3, 4, 5, 6]


def test_held_batches_up_to_the_last_seq_are_dropped_and_the_rest_applied_in_order():
    splice = holding()
    for seq in (3, 4, 5, 6):
        splice.admit(batch(seq))
    spliced = splice.on_snapshot(4)
    assert seqs(spliced.batches) == [5, 6] and spliced.is_complete
    assert splice.held is None and splice.last_seq is None
    live = splice.admit(batch(7))
    assert seqs(live.batches) == [7] and live.makes_warm is False and live.fetch == "none"


def test_a_snapshot_taken_before_anything_was_published_keeps_every_held_batch():
    splice = holding()
    splice.admit(batch(0))
    splice.admit(batch(1))
    spliced = splice.on_snapshot(-1)
    assert seqs(spliced.batches) == [0, 1] and spliced.is_complete


def test_live_batches_after_the_snapshot_at_or_below_its_last_seq_are_dropped():
    splice = holding()
    assert splice.on_snapshot(9) == Spliced((), True)
    assert splice.last_seq == 9  # nothing held: the next live batch must be 10
    assert splice.admit(batch(8)) == Admitted((), False, "none")
    assert splice.admit(batch(9)) == Admitted((), False, "none")
    assert seqs(splice.admit(batch(10)).batches) == [10]
    assert splice.last_seq is None
    assert seqs(splice.admit(batch(12)).batches) == [12]  # live now: a later hole is the subscriber's business


def test_a_held_batch_past_a_hole_stays_held_with_the_rest_and_the_snapshot_is_fetched_again():
    splice = holding()
    for seq in (3, 4, 6, 7):
        splice.admit(batch(seq))
    spliced = splice.on_snapshot(4)  # 3 and 4 are in it; 5 was never seen
    assert spliced == Spliced((), False)
    assert splice.held is not None and seqs(tuple(splice.held)) == [6, 7]
    assert splice.num_refetches == 1 and splice.last_seq is None
    assert splice.admit(batch(8)) == Admitted((), False, "none")  # still holding
    again = splice.on_snapshot(7)  # taken after 6 and 7 arrived: it holds them; 8 came after the fetch began
    assert seqs(again.batches) == [8] and again.is_complete
    assert splice.num_refetches == 0 and splice.num_stale_dropped == 0


def test_only_the_first_batch_after_the_snapshot_is_checked_for_a_hole():
    splice = holding()
    for seq in (5, 7):  # the subscriber's own seq tracking vouches for the stream after the first batch
        splice.admit(batch(seq))
    spliced = splice.on_snapshot(4)
    assert seqs(spliced.batches) == [5, 7] and spliced.is_complete


def test_a_live_batch_past_a_hole_after_the_snapshot_restarts_the_fetch_and_is_held():
    splice = holding()
    splice.on_snapshot(4)
    assert splice.admit(batch(7)) == Admitted((), False, "restart")
    assert splice.held is not None and seqs(tuple(splice.held)) == [7]
    assert splice.num_refetches == 1
    spliced = splice.on_snapshot(7)
    assert spliced == Spliced((), True) and splice.last_seq == 7


def test_refetches_in_a_row_are_bounded_then_the_batch_is_applied():
    splice = holding(max_refetches=2)
    splice.on_snapshot(4)
    assert splice.admit(batch(6)).fetch == "restart"  # refetch number 1; 6 came before it
    splice.admit(batch(9))  # came after the refetch began
    assert splice.on_snapshot(6).is_complete is False  # 6 is in it; 9 is past a hole again: refetch number 2
    assert splice.num_refetches == 2
    splice.admit(batch(12))
    spliced = splice.on_snapshot(10)  # 9 is in it; 12 is past a hole once more, but the refetches are spent
    assert seqs(spliced.batches) == [12] and spliced.is_complete and splice.num_refetches == 0


def test_too_many_held_batches_give_the_snapshot_up_and_apply_them_all():
    splice = holding(max_held_batches=2)
    assert splice.admit(batch(1)).batches == ()
    assert splice.admit(batch(2)).batches == ()
    over = splice.admit(batch(3))
    assert seqs(over.batches) == [1, 2, 3] and over.makes_warm and over.fetch == "cancel"
    assert splice.held is None
    assert splice.admit(batch(4)) == Admitted((batch(4),), True, "none")


def test_no_snapshot_applies_the_held_batches_and_warms_on_the_first_batch():
    splice = holding()
    splice.admit(batch(1))
    splice.admit(batch(2))
    step = splice.on_no_snapshot()
    assert seqs(step.batches) == [1, 2] and step.makes_warm
    empty = holding()
    assert empty.on_no_snapshot() == Admitted((), False, "none")
    assert empty.admit(batch(0)) == Admitted((batch(0),), True, "none")


def test_a_worker_that_does_not_splice_applies_at_once_and_is_complete_on_its_snapshot():
    splice = SnapshotSplice("w0", splices=False)
    splice.begin()
    assert splice.held is None
    assert splice.admit(batch(5)) == Admitted((batch(5),), True, "none")
    assert splice.on_snapshot(9) == Spliced((), True)
    assert splice.admit(batch(6)) == Admitted((batch(6),), True, "none")


def test_beginning_again_while_holding_keeps_the_held_batches_for_the_next_snapshot():
    splice = holding()
    splice.admit(batch(1))
    splice.admit(batch(2))
    splice.begin()  # a resync while the snapshot is fetched
    assert splice.num_held_before_fetch == 2
    splice.admit(batch(3))
    assert seqs(splice.on_snapshot(2).batches) == [3]  # 1 and 2 are in the snapshot taken after them
    no_snapshot = holding()
    no_snapshot.admit(batch(1))
    no_snapshot.begin()
    no_snapshot.admit(batch(2))
    assert seqs(no_snapshot.on_no_snapshot().batches) == [1, 2]  # without a snapshot every held batch is applied


def test_a_batch_of_the_publisher_before_its_restart_is_dropped_not_spliced():
    # The restarted worker's old process published seq 5 (10 stored blocks); it reached the gateway after the
    # socket's disconnect, so it was held. A resync (the new start id) begins a fetch: the new process's snapshot
    # says nothing was published before it (-1). Seq 5 came before that fetch, so the snapshot would hold it if
    # the same process had published it: it is stale.
    splice = holding()
    splice.admit(batch(5))
    splice.begin()
    spliced = splice.on_snapshot(-1)
    assert spliced == Spliced((), True) and splice.num_stale_dropped == 1 and splice.num_refetches == 0
    assert splice.held is None and splice.last_seq == -1
    assert seqs(splice.admit(batch(0)).batches) == [0]  # the new process's first batch follows the snapshot


def test_a_late_batch_of_the_old_publisher_after_the_snapshot_is_fetched_again_then_dropped():
    splice = holding()
    assert splice.on_snapshot(-1) == Spliced((), True)  # the new process: nothing published yet
    assert splice.admit(batch(5)) == Admitted((), False, "restart")  # the old process's seq 5, late
    spliced = splice.on_snapshot(-1)  # the next snapshot, taken after 5 arrived, still does not reach it
    assert spliced == Spliced((), True) and splice.num_stale_dropped == 1 and splice.num_refetches == 1


def test_negative_limits_are_refused():
    with pytest.raises(ValueError, match="max_held_batches=-1"):
        SnapshotSplice("w0", splices=True, max_held_batches=-1)
