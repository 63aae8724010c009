"""The pool-store journal of the honesty check: which blocks a member of a shared pool put to it, and when.

A ``mooncake_master`` evicts without telling anyone, and a worker announces only the losses of objects it stored
or read (``workers.kv.pool_tier``), so when the master evicts an object another member stored, the worker whose
lookup misses it announces nothing: it computes the blocks and, since a worker puts only an object the pool lacks
(the store rule of ``workers.kv.pool_tier.PoolTier.prepare_store``, as vLLM's Mooncake connector checks
``batch_is_exist`` first), puts them again, often before its answer. By the time the pool watcher asks the master
about the blocks not served (``router.pool_watch.PoolWatcher.confirm_gone``) they are present again, and "present
again" reads as "never gone": a wrong index. The sequence, for a block ``b`` another member ``A`` put::

    A puts b, announces BlockStored(MOONCAKE)   the index: b in the pool (A)
    decision for a request on B: b priced as a pool hit (journal stamp s)
    the master evicts b (no one is told)
    B's lookup misses b: B computes it, reports fewer cached tokens
    B puts b again (absent), announces BlockStored(MOONCAKE)   -> Slot.pool_stored[b] = s' > s
    the watcher asks the master about b: present

This module journals every group 0 store of a pool member on its pool's lane (``Slot.pool_stored``, a
``router.index.slots.Journal`` stamped with the index's ``journal_seq``), and ``restored_since`` reads it: the
first block a worker did not serve, put to the pool by that same worker after the decision's stamp, was absent
from the pool at its put, after the decision; the index priced it in the pool from an announced put (members
announce a put only once it landed), so the pool lost it in between: a forecast miss, not a wrong index. The
answer often reaches the gateway before the worker's events, so the request lifecycle reads the cause again once
the watcher's confirmation is answered (``router.lifecycle.RequestLifecycle.count_mismatch``).

What it cannot tell apart: a pool block the index credited though no put of it had ever landed reads the same
once the worker put it. A genuine wrong index is still counted whenever the worker did not put that block after
the decision: the gateway hashed other tokens than the worker computed (a tokenizer or chat template that
disagrees), the worker missed a block the master still holds, or its put was refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from events.types import Medium
from router.index.slots import Slot
from router.index.state import IndexState


def note_pool_stores(
    state: IndexState, slot: Slot, medium: Medium, group_idx: int, block_hashes: Sequence[int]
) -> None:
    """Journal a store of ``block_hashes`` (our hashes) on ``medium`` by ``slot``, when it is a group 0 store of a
    member of that pool (else nothing): one journal stamp for the whole store. O(len(block_hashes))."""
    if group_idx != 0 or not block_hashes or slot.worker_id not in state.pool_members.get(medium, ()):
        return
    state.journal_seq += 1
    seq = state.journal_seq
    journal = slot.pool_stored
    floor = state.journal_floor
    for block_hash in block_hashes:
        journal.note(block_hash, seq, floor)


def restored_since(state: IndexState, worker_id: str, block_hash: int, seq: int) -> bool:
    """Whether ``worker_id`` (any dp rank) put ``block_hash`` to a shared pool it is a member of after the index's
    ``journal_seq`` was ``seq`` (a stamp held open: ``PrefixIndex.open_journal_window``). O(its slots)."""
    return any(slot.pool_stored.get(block_hash, 0) > seq for slot in state.worker_slots(worker_id))
