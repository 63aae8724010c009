"""The prefix index's invariants, recomputed from scratch (``router.index.state`` lists them)."""

from __future__ import annotations

from collections import Counter

from router.index.state import DANGLING, ENTRY, FREE, NULL_ID, UNSTAMPED, IndexState


def check_invariants(state: IndexState) -> None:
    """Recompute the derived structures from scratch and compare (for tests and debugging; O(index)).

    Raises:
        RuntimeError: the id tables, children, dangling keys, the eviction log, ``num_held`` or the gap
            counts disagree with the parent links and the lanes.
    """
    num_ids = state.num_ids
    kind = state.kind
    parent = state.parent
    tables = (state.hash_of, parent, kind, state.stamp, *state.lanes.values())
    if any(len(table) != num_ids for table in tables):
        raise RuntimeError("per-id tables differ in length")
    if kind[NULL_ID] != FREE or any(lane[NULL_ID] for lane in state.lanes.values()):
        raise RuntimeError("the null id is in use")
    for block_hash, entry_id in state.id_of.items():
        if state.hash_of[entry_id] != block_hash or kind[entry_id] == FREE:
            raise RuntimeError(f"id_of[{block_hash}] = {entry_id} disagrees with the id tables")
    free = [i for i in range(1, num_ids) if kind[i] == FREE]
    if len(state.id_of) + len(free) != num_ids - 1 or sorted(free) != sorted(state.free_ids):
        raise RuntimeError("free ids disagree with the kinds")
    entries = [i for i in range(1, num_ids) if kind[i] & 1]
    if len(entries) != state.num_entries:
        raise RuntimeError(f"{state.num_entries} entries counted, {len(entries)} real")
    expected: dict[int, list[int]] = {}
    for child in entries:
        if kind[child] == ENTRY:
            up = parent[child]
            if not (kind[up] & 1 or kind[up] == DANGLING):
                raise RuntimeError(f"entry {child} has a free parent id {up}")
            expected.setdefault(up, []).append(child)
        elif parent[child] != NULL_ID:
            raise RuntimeError(f"rooted entry {child} has a parent")
    actual = {up: sorted(state.iter_children(up)) for up in range(1, num_ids)}
    if {up: c for up, c in actual.items() if c} != {up: sorted(c) for up, c in expected.items()}:
        raise RuntimeError("children disagree with parent links")
    dangling = [i for i in range(1, num_ids) if kind[i] == DANGLING]
    if len(dangling) != state.num_dangling or any(i not in expected for i in dangling):
        raise RuntimeError("dangling keys disagree")
    log = state.log
    num_records = Counter(log)
    for entry_id in entries:
        pos = state.stamp[entry_id]
        if pos == UNSTAMPED and num_records[entry_id] == 1:
            continue
        if not 0 <= pos < len(log) or log[pos] != entry_id:
            raise RuntimeError(f"entry {entry_id} has no valid eviction record")
        if not state.is_held(entry_id) and entry_id not in expected:
            raise RuntimeError(f"entry {entry_id} has neither holders nor children")
    for lane_key, lane in state.lanes.items():
        if any(lane[i] and not kind[i] & 1 for i in range(num_ids)):
            raise RuntimeError(f"a block held on {lane_key} is not an entry")
        if state.lane_sizes[lane_key] != sum(1 for m in lane if m):
            raise RuntimeError(f"size of lane {lane_key} is off")
    dirty = 0
    gpu = state.gpu0
    for slot in state.slots.values():
        mask = slot.mask
        for lane_key, lane in state.lanes.items():
            if slot.num_held.get(lane_key, 0) != sum(1 for m in lane if m & mask):
                raise RuntimeError(f"num_held of {slot.worker_id}/{slot.dp_rank} on {lane_key} is off")
        num_gaps = sum(1 for i in range(num_ids) if gpu[i] & mask and state.is_gap(mask, i))
        if num_gaps != slot.num_gaps:
            raise RuntimeError(f"{slot.worker_id}/{slot.dp_rank}: {slot.num_gaps} gaps counted, {num_gaps} real")
        if num_gaps:
            dirty |= mask
    if dirty != state.dirty_mask:
        raise RuntimeError("dirty mask disagrees with the gap counts")
