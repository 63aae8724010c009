"""The honesty check's journals (``router.index.slots.Journal``) keep what an open decision can read and no more:
pruned of the entries at or below the oldest open stamp once they reach ``prune_at``, each pruning a new table, and
never past ``MAX_EVICTED``; the index holds a stamp open from a ticket's match until the ticket goes."""

from __future__ import annotations

import sys

import pytest

from events.types import BlockRemoved, BlockStored, EventBatch
from router.config import ModelConfig
from router.index import IndexConfig, PrefixIndex
from router.index.slots import JOURNAL_PRUNE_MIN, MAX_EVICTED, Journal
from router.request_view import PromptView
from router.routing import IndexTicket

pytestmark = pytest.mark.unit


def filled(num_entries: int, floor: int) -> Journal:
    """A journal of hashes ``0 .. num_entries - 1`` stamped ``1 .. num_entries``, pruned at ``floor``."""
    journal = Journal()
    for i in range(num_entries):
        journal.note(i, i + 1, lambda: floor)
    return journal


def test_a_journal_below_its_first_pruning_length_keeps_every_entry():
    journal = filled(JOURNAL_PRUNE_MIN - 1, floor=10**9)
    assert len(journal) == JOURNAL_PRUNE_MIN - 1 and journal.prune_at == JOURNAL_PRUNE_MIN
    assert journal[0] == 1 and journal[JOURNAL_PRUNE_MIN - 2] == JOURNAL_PRUNE_MIN - 1


def test_pruning_drops_the_entries_no_open_stamp_reads_and_doubles_what_it_kept():
    floor = JOURNAL_PRUNE_MIN - 100  # the oldest open decision's stamp: entries stamped after it stay
    journal = filled(JOURNAL_PRUNE_MIN, floor)
    assert len(journal) == 100
    assert list(journal) == list(range(JOURNAL_PRUNE_MIN - 100, JOURNAL_PRUNE_MIN))
    assert min(journal.values()) == floor + 1 and max(journal.values()) == JOURNAL_PRUNE_MIN
    assert journal.prune_at == JOURNAL_PRUNE_MIN  # at least the first length again
    # With every entry still readable the next pruning keeps all of them and waits for twice as many.
    everything = filled(JOURNAL_PRUNE_MIN, floor=0)
    assert len(everything) == JOURNAL_PRUNE_MIN and everything.prune_at == 2 * JOURNAL_PRUNE_MIN


def test_no_open_stamp_empties_the_journal_into_a_small_table():
    journal = filled(JOURNAL_PRUNE_MIN - 1, floor=0)
    peak_bytes = sys.getsizeof(journal)
    journal.note(-1, JOURNAL_PRUNE_MIN, lambda: JOURNAL_PRUNE_MIN)  # floor = the current stamp: nothing open
    assert len(journal) == 0 and journal.prune_at == JOURNAL_PRUNE_MIN
    assert sys.getsizeof(journal) == sys.getsizeof(Journal()) < peak_bytes // 100


def test_a_block_stamped_again_moves_to_the_newest_end():
    journal = Journal()
    for block_hash, seq in ((7, 1), (8, 2), (7, 3)):
        journal.note(block_hash, seq, lambda: 0)
    assert list(journal.items()) == [(8, 2), (7, 3)]


def test_past_max_evicted_only_the_newest_half_stays_whatever_is_open():
    journal = filled(MAX_EVICTED + 1, floor=0)  # every decision still open
    assert len(journal) == MAX_EVICTED // 2
    assert next(iter(journal.items())) == (MAX_EVICTED + 1 - MAX_EVICTED // 2, MAX_EVICTED + 2 - MAX_EVICTED // 2)
    assert journal.prune_at == MAX_EVICTED  # twice what it kept


BS = 4


def stored(first: int, last: int) -> BlockStored:
    return BlockStored(block_hashes=tuple(range(first, last)), parent_block_hash=first - 1 if first else None,
                       token_ids=tuple(range(first * BS, last * BS)), block_size=BS)


def ticket(index: PrefixIndex) -> IndexTicket:
    view = PromptView(num_tokens=8, block_hashes=(11, 12), block_size=BS)
    return IndexTicket(index, ModelConfig(name="m", block_size=BS), view, {})


def test_a_ticket_holds_its_stamp_open_from_its_match_until_it_goes():
    index = PrefixIndex(IndexConfig(block_size=BS))
    state = index.state
    index.apply(EventBatch("w0", 0, 0, 0.0, (stored(0, 8),)))
    index.apply(EventBatch("w0", 0, 1, 0.0, (BlockRemoved(block_hashes=(7,)),)))
    assert state.journal_floor() == index.journal_seq == 1  # nothing open: the current stamp
    first = ticket(index)
    assert state.windows.open == {}  # not matched yet
    first.match()
    second = ticket(index)
    second.match()
    assert state.windows.open == {1: 2}
    index.apply(EventBatch("w0", 0, 2, 0.0, (BlockRemoved(block_hashes=(6,)),)))
    third = ticket(index)
    third.match()
    third.match()  # matched again: one stamp per ticket, the newer
    assert state.windows.open == {1: 2, 2: 1} and state.journal_floor() == 1
    del first
    assert state.windows.open == {1: 1, 2: 1}
    del second
    assert state.windows.open == {2: 1} and state.journal_floor() == 2
    del third
    assert state.windows.open == {} and state.journal_floor() == 2
    index.close_journal_window(5)  # unknown: ignored
    assert state.windows.open == {}


def test_a_worker_journal_keeps_only_the_evictions_after_the_oldest_open_decision():
    num_blocks = JOURNAL_PRUNE_MIN + 8
    index = PrefixIndex(IndexConfig(block_size=BS, max_blocks=4 * num_blocks))
    index.apply(EventBatch("w0", 0, 0, 0.0, (stored(0, num_blocks),)))
    index.apply(EventBatch("w0", 0, 1, 0.0, tuple(BlockRemoved(block_hashes=(h,)) for h in range(10))))
    open_ticket = ticket(index)
    open_ticket.match()  # stamp 10: the evictions 11 .. are what it may read
    removals = tuple(BlockRemoved(block_hashes=(h,)) for h in range(num_blocks - 1, 9, -1))  # leaf first
    index.apply(EventBatch("w0", 0, 2, 0.0, removals[: JOURNAL_PRUNE_MIN - 10]))
    slot = index.state.worker_slots("w0")[0]
    # The pruning at JOURNAL_PRUNE_MIN entries dropped the 10 stamped up to the open one (1 .. 10), kept the rest.
    assert len(slot.evicted) == JOURNAL_PRUNE_MIN - 10
    assert (min(slot.evicted.values()), max(slot.evicted.values())) == (11, JOURNAL_PRUNE_MIN)
    assert slot.evicted.prune_at == 2 * (JOURNAL_PRUNE_MIN - 10)
    del open_ticket
    index.apply(EventBatch("w0", 0, 3, 0.0, removals[JOURNAL_PRUNE_MIN - 10:]))
    assert len(slot.evicted) == JOURNAL_PRUNE_MIN - 2  # below the next pruning length
    slot.evicted.prune(index.state.journal_floor())  # nothing open: the floor is the current stamp
    assert len(slot.evicted) == 0 and index.state.journal_floor() == index.journal_seq == JOURNAL_PRUNE_MIN + 8
