"""Cache groups of hybrid models beside the main full-attention pool: sliding-window blocks and recurrent-state
checkpoints.

A hybrid model keeps several caches per sequence (vLLM's KV-cache groups; ``group_idx`` is the group's position in
``kv-cache.groups``, group 0 being the main full-attention pool of ``workers.kv.manager``)::

    group kind       what a sequence holds                  what a later request can reuse
    full             every block                            any prefix of held blocks
    sliding_window   the blocks of its last window          a prefix whose last ceil((W - 1) / B) blocks are held
    recurrent        one state (S bytes), overwritten       a prefix ending at a checkpoint of that state
                     by every token

A prefix of ``L`` blocks is usable only as far as every group can serve it (the largest ``L`` all groups accept,
``HybridGroups.usable_blocks``): the gateway's index applies the same rule to the same events
(``router.index.match``), so predicted cached tokens equal the reported ones.

Sliding window (``SlidingWindowGroup``): its own ``BlockPool``. Blocks are registered as they are computed; once
a block lies wholly before the window of the next token (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``:
``max(0, num_computed_tokens - W + 1)`` tokens), the sequence drops it into the free queue, most recent first, as
vLLM's ``remove_skipped_blocks`` does. It stays cached (a shorter prefix may still use it) until the pool evicts
it: then ``BlockRemoved`` with its ``group_idx``. Its evictions never touch the main pool.

Recurrent state (``RecurrentGroup``): a sequence's state exists only at its current position. Checkpoints copy
it into a bounded pool at block boundaries the computation crosses (vLLM's Mamba ``align`` mode keeps states
block-aligned the same way): every ``interval_tokens``, at the prompt's last block boundary, and, when the request
finishes, at the last boundary it computed, so a returning session resumes after its own generated tokens. A
checkpoint is content-addressed by the chain hash of the block ending there; a store of one already kept only
refreshes it (traffic that never returns pays one copy per prompt and one per generation, nothing per token).
Pool order: least recently used first (front evicted next); a resume refreshes. With a CPU tier, every new
checkpoint is written through to host memory (bounded LRU too); a resume from there copies it back.

Events (vLLM's shapes, ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py::take_events``): every
``BlockStored`` of a group carries its ``group_idx``, ``kv_cache_spec_kind`` (``"sliding_window"`` with
``kv_cache_spec_sliding_window``, or ``"mamba"``) and the plain engine hash of its block (the same value the
main group publishes for that block: the group, not the hash, tells the groups apart, as vLLM does). A
checkpoint is the ``BlockStored`` of one block (the block ending at the checkpoint, parent the block before it,
its ``block_size`` tokens): exactly what vLLM's Mamba group sends for a kept state, so any vLLM consumer reads
it. ``BlockRemoved`` carries the group. Within the worker every group has its own table, so a key is (group,
hash) by construction and one group's eviction can never drop another's entry.

Costs (``take_costs``, charged by the sim engine in the next step): each committed or refreshed-from-CPU
checkpoint copies ``state_bytes`` on the device (committing) or host to device (resuming from CPU).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from events.types import BlockRemoved, BlockStored, KVEvent, Medium, SpecKind
from workers.config import CacheGroupConfig, CheckpointConfig
from workers.errors import KVCacheError
from workers.kv.block_pool import BlockMeta, BlockPool, engine_hash_of, stored_events
from workers.kv.hashing import BlockHash, to_engine_hash
from workers.kv.pool_tier import KEY_PREFIX, PoolStore

logger = logging.getLogger(__name__)


class CheckpointCosts(msgspec.Struct, frozen=True, gc=False):
    """Recurrent-state copies made since the last ``take_costs``.

    Attributes:
        num_commits: checkpoints copied out of a sequence's live state (device to device).
        commit_bytes: bytes those copies moved.
        num_cpu_restores: checkpoints copied back from host memory for a resume.
        cpu_restore_bytes: bytes those copies moved (host to device).
        num_cpu_stores: checkpoints written through to host memory.
        cpu_store_bytes: bytes those copies moved (device to host).
        num_pool_restores: checkpoints read back from the shared pool for a resume.
        pool_restore_bytes: bytes those reads moved (pool to device).
        num_pool_stores: checkpoints written through to the shared pool.
        pool_store_bytes: bytes those writes moved (device to pool).
    """

    num_commits: int = 0
    commit_bytes: int = 0
    num_cpu_restores: int = 0
    cpu_restore_bytes: int = 0
    num_cpu_stores: int = 0
    cpu_store_bytes: int = 0
    num_pool_restores: int = 0
    pool_restore_bytes: int = 0
    num_pool_stores: int = 0
    pool_store_bytes: int = 0


def checkpoint_key(group_idx: int, block_hash: BlockHash) -> str:
    """The shared-pool key of group ``group_idx``'s checkpoint ending at block ``block_hash`` (its own key
    space: ``kvgate/v1/ckpt/<group_idx>/<hex>``, never a block's ``kvgate/v1/<hex>``)."""
    return f"{KEY_PREFIX}ckpt/{group_idx}/{block_hash.hex()}"


def checkpoint_value(group_idx: int, block_hash: BlockHash) -> bytes:
    """A checkpoint's value in the sim engine (no state bytes): its group and block hash, checked on a read.
    A GPU engine would put the recurrent state itself."""
    return b"kvgate-ckpt" + group_idx.to_bytes(4, "little") + block_hash


def _tag(event: KVEvent, group_idx: int, kind: str, window: int | None) -> KVEvent:
    """The event as group ``group_idx`` publishes it (``take_events`` of vLLM annotates stores the same way)."""
    if isinstance(event, BlockStored):
        return msgspec.structs.replace(
            event, group_idx=group_idx, kv_cache_spec_kind=kind, sliding_window_tokens=window
        )
    if isinstance(event, BlockRemoved):
        return msgspec.structs.replace(event, group_idx=group_idx)
    return event


class SlidingWindowGroup:
    """A sliding-window attention group: its own block pool and one block table per sequence (module docstring).

    A sequence's table is position-aligned with its blocks: ``None`` where a block left the window (or was never
    needed: the part of a hit before the window).
    """

    def __init__(
        self, group_idx: int, num_blocks: int, block_size: int, window_tokens: int, emit: Callable[[KVEvent], None]
    ) -> None:
        self.group_idx = group_idx
        self.block_size = block_size
        self.window_tokens = window_tokens
        self.num_window_blocks = -(-(window_tokens - 1) // block_size)
        """Blocks a hit of ``L`` blocks needs at its end (vLLM's ``SlidingWindowManager`` rule)."""
        self._emit = emit
        self.pool = BlockPool(num_blocks, block_size, self._emit_tagged)
        self._tables: dict[str, list[int | None]] = {}
        self._num_registered: dict[str, int] = {}

    def _emit_tagged(self, event: KVEvent) -> None:
        self._emit(_tag(event, self.group_idx, SpecKind.SLIDING_WINDOW, self.window_tokens))

    def usable(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[bool]:
        """``out[L]`` for ``L in 0..max_blocks``: the group can serve a prefix of ``L`` blocks."""
        cached = self.pool.get_cached_block
        out = [True]
        run = 0
        for i in range(max_blocks):
            run = run + 1 if cached(hashes[i]) is not None else 0
            out.append(run >= min(self.num_window_blocks, i + 1))
        return out

    def _hit_ids(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[int]:
        first = max(0, num_blocks - self.num_window_blocks)
        ids = [self.pool.get_cached_block(h) for h in hashes[first:num_blocks]]
        if any(b is None for b in ids):
            raise KVCacheError(f"sliding-window group {self.group_idx}: hit of {num_blocks} blocks not held")
        return [b for b in ids if b is not None]

    def can_admit(self, hashes: Sequence[BlockHash], num_hit_blocks: int, num_tokens: int) -> bool:
        """Whether ``admit`` would find its blocks (no state change)."""
        hit = self._hit_ids(hashes, num_hit_blocks)
        num_new = max(0, -(-num_tokens // self.block_size) - num_hit_blocks)
        return num_new <= self.pool.num_free_blocks - self.pool.num_free_among(hit)

    def admit(self, request_id: str, hashes: Sequence[BlockHash], num_hit_blocks: int, num_tokens: int) -> None:
        """Give a sequence the window of its hit and blocks up to ``num_tokens`` (``can_admit`` was true)."""
        hit = self._hit_ids(hashes, num_hit_blocks)
        self.pool.touch(hit)
        num_new = max(0, -(-num_tokens // self.block_size) - num_hit_blocks)
        table: list[int | None] = [None] * (num_hit_blocks - len(hit))
        table.extend(hit)
        table.extend(self.pool.allocate(num_new))
        self._tables[request_id] = table
        self._num_registered[request_id] = num_hit_blocks

    def num_blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """New blocks ``grow`` would take."""
        return max(0, -(-num_tokens // self.block_size) - len(self._tables.get(request_id, ())))

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Extend the sequence's table to cover ``num_tokens`` (the caller checked the free blocks)."""
        num_new = self.num_blocks_to_grow(request_id, num_tokens)
        if num_new:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(num_new))

    def cache_computed(self, request_id: str, metas: Sequence[BlockMeta], num_computed_tokens: int) -> None:
        """Register newly computed blocks (``metas`` start at the sequence's first unregistered block), then free
        the ones the next token's window no longer reads."""
        table = self._tables.get(request_id)
        if table is None:
            return
        start = self._num_registered[request_id]
        ids: list[int] = []
        kept: list[BlockMeta] = []
        for offset, meta in enumerate(metas):
            block_id = table[start + offset] if start + offset < len(table) else None
            if block_id is not None:
                ids.append(block_id)
                kept.append(meta)
        self.pool.cache_blocks(ids, kept)
        self._num_registered[request_id] = start + len(metas)
        num_skipped = max(0, num_computed_tokens - self.window_tokens + 1) // self.block_size
        freed: list[int] = []
        for i in range(min(num_skipped, len(table)) - 1, -1, -1):
            block_id = table[i]
            if block_id is None:
                break
            freed.append(block_id)
            table[i] = None
        if freed:
            self.pool.free(freed)

    def free(self, request_id: str) -> None:
        """Release the sequence's blocks, tail first (idempotent)."""
        table = self._tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            self.pool.free(b for b in reversed(table) if b is not None)

    def table(self, request_id: str) -> list[int | None]:
        """Test-only: the sequence's block table (``None`` for blocks outside the window)."""
        return list(self._tables.get(request_id, ()))


class RecurrentGroup:
    """A recurrent-state group: live states per sequence and a bounded checkpoint pool (module docstring)."""

    def __init__(
        self,
        group_idx: int,
        block_size: int,
        state_bytes: int,
        config: CheckpointConfig,
        emit: Callable[[KVEvent], None],
        pool: PoolStore | None = None,
    ) -> None:
        self.group_idx = group_idx
        self.block_size = block_size
        self.state_bytes = state_bytes
        self.config = config
        self._emit = emit
        self._pool_store = pool
        self._gpu: OrderedDict[BlockHash, BlockMeta] = OrderedDict()
        self._cpu: OrderedDict[BlockHash, BlockMeta] = OrderedDict()
        self._pool_known: dict[str, BlockMeta] = {}
        """Pool checkpoints this worker announced (stored, or read for a resume): their removals it publishes."""
        self._staged: set[BlockHash] = set()
        """Checkpoints read from the pool by ``fetch_from_pool`` for the resume that follows."""
        self._last_boundary: dict[str, BlockMeta] = {}
        self._costs = CheckpointCosts()
        self.num_commits = 0
        self.num_resumes = 0
        self.num_evicted = 0

    # -- lookups ----------------------------------------------------------------------------------------------

    def has(self, block_hash: BlockHash) -> bool:
        """Whether a checkpoint ends at the block ``block_hash`` (GPU, CPU or the shared pool)."""
        return self.usable([block_hash], 1)[1]

    def usable(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[bool]:
        """``out[L]`` for ``L in 0..max_blocks``: a checkpoint ends at block ``L - 1`` (``L == 0``: from scratch);
        the pool is asked once, for the blocks no local tier holds."""
        local = [h in self._gpu or h in self._cpu or h in self._staged for h in hashes[:max_blocks]]
        if self._pool_store is not None:
            missing = [i for i, ok in enumerate(local) if not ok]
            if missing:
                found = self._pool_store.exists([checkpoint_key(self.group_idx, hashes[i]) for i in missing])
                for i, ok in zip(missing, found, strict=True):
                    local[i] = ok
        return [True, *local]

    def fetch_from_pool(self, block_hash: BlockHash) -> bool:
        """Make the checkpoint at ``block_hash`` resumable here: True when a local tier holds it or it was read
        intact from the pool (into host memory, so a pool eviction before the resume cannot bite)."""
        if block_hash in self._gpu or block_hash in self._cpu or block_hash in self._staged:
            return True
        if self._pool_store is None:
            return False
        (value,) = self._pool_store.get([checkpoint_key(self.group_idx, block_hash)])
        if value is None or value != checkpoint_value(self.group_idx, block_hash):
            return False
        self._staged.add(block_hash)
        return True

    def checkpoint_hashes(self, medium: Medium = Medium.GPU) -> list[BlockHash]:
        """Test-only: the kept checkpoints of one tier, least recently used first."""
        return list(self._gpu if medium is Medium.GPU else self._cpu)

    # -- resume and commit ------------------------------------------------------------------------------------

    def resume(self, request_id: str, hashes: Sequence[BlockHash], num_hit_blocks: int, meta: BlockMeta | None) -> None:
        """A sequence starts from the checkpoint at block ``num_hit_blocks - 1`` (or from scratch at 0).

        Args:
            request_id: the sequence.
            hashes: its block hashes.
            num_hit_blocks: the usable prefix it was admitted with.
            meta: the meta of block ``num_hit_blocks - 1`` (to republish a checkpoint restored from CPU).
        """
        self._last_boundary.pop(request_id, None)
        if num_hit_blocks == 0:
            return
        key = hashes[num_hit_blocks - 1]
        if key in self._gpu:
            self._gpu.move_to_end(key)
        elif key in self._cpu:
            self._cpu.move_to_end(key)
            if meta is None:
                raise KVCacheError(f"resume of {request_id} from a CPU checkpoint without its block")
            self._insert_gpu(meta)
            self._add_costs(num_cpu_restores=1, cpu_restore_bytes=self.state_bytes)
        elif key in self._staged:
            if meta is None:
                raise KVCacheError(f"resume of {request_id} from a pool checkpoint without its block")
            self._staged.discard(key)
            pool_key = checkpoint_key(self.group_idx, key)
            if pool_key not in self._pool_known:
                self._pool_known[pool_key] = meta
                self._emit(self._stored(meta, Medium.MOONCAKE))
            self._insert_gpu(meta)
            self._add_costs(num_pool_restores=1, pool_restore_bytes=self.state_bytes)
        else:
            raise KVCacheError(f"recurrent group {self.group_idx}: no checkpoint at block {num_hit_blocks - 1}")
        self.num_resumes += 1

    def on_computed(self, request_id: str, metas: Sequence[BlockMeta], num_prompt_tokens: int) -> None:
        """The sequence's computation crossed the block boundaries at the ends of ``metas`` (in order)."""
        if not metas:
            return
        bs = self.block_size
        interval = self.config.interval_tokens
        prompt_end_block = num_prompt_tokens // bs - 1
        for meta in metas:
            end_tokens = (meta.depth + 1) * bs
            if (interval and end_tokens % interval == 0) or (
                self.config.at_prompt_end and meta.depth == prompt_end_block
            ):
                self.commit(meta)
        self._last_boundary[request_id] = metas[-1]

    def end_turn(self, request_id: str) -> None:
        """The request finished: checkpoint its last boundary (``at_generation_end``) and drop its live state."""
        meta = self._last_boundary.pop(request_id, None)
        if meta is not None and self.config.at_generation_end:
            self.commit(meta)

    def free(self, request_id: str) -> None:
        """Drop a sequence's live state without a checkpoint (preemption, abort)."""
        self._last_boundary.pop(request_id, None)

    def commit(self, meta: BlockMeta) -> None:
        """Keep the state at the end of ``meta``'s block as a checkpoint (a refresh when it is kept already)."""
        key = meta.block_hash
        if key in self._gpu:
            self._gpu.move_to_end(key)
            return
        self._insert_gpu(meta)
        self.num_commits += 1
        self._add_costs(num_commits=1, commit_bytes=self.state_bytes)
        if self.config.num_cpu_checkpoints and key not in self._cpu:
            self._cpu[key] = meta
            self._emit(self._stored(meta, Medium.CPU))
            self._add_costs(num_cpu_stores=1, cpu_store_bytes=self.state_bytes)
            while len(self._cpu) > self.config.num_cpu_checkpoints:
                old, old_meta = self._cpu.popitem(last=False)
                self._emit(BlockRemoved((engine_hash_of(old_meta),), Medium.CPU, self.group_idx))
        elif key in self._cpu:
            self._cpu.move_to_end(key)
        self._write_pool(meta)

    def _write_pool(self, meta: BlockMeta) -> None:
        """Write a new checkpoint through to the shared pool (skipped when some worker put it there already);
        announced only once put (``BlockStored`` MOONCAKE, as a pool block is)."""
        store = self._pool_store
        if store is None:
            return
        key = checkpoint_key(self.group_idx, meta.block_hash)
        if key in self._pool_known or store.exists([key])[0]:
            return
        (ok,) = store.put([key], [checkpoint_value(self.group_idx, meta.block_hash)])
        if not ok:
            return
        self._pool_known[key] = meta
        self._emit(self._stored(meta, Medium.MOONCAKE))
        self._add_costs(num_pool_stores=1, pool_store_bytes=self.state_bytes)

    def on_pool_evict(self, keys: Sequence[str]) -> None:
        """The pool evicted ``keys``: ``BlockRemoved`` (MOONCAKE, this group) for the checkpoints announced here."""
        gone = [m for m in (self._pool_known.pop(k, None) for k in keys) if m is not None]
        if gone:
            self._emit(BlockRemoved(tuple(map(engine_hash_of, gone)), Medium.MOONCAKE, self.group_idx))

    def _insert_gpu(self, meta: BlockMeta) -> None:
        self._gpu[meta.block_hash] = meta
        self._emit(self._stored(meta, Medium.GPU))
        while len(self._gpu) > self.config.max_checkpoints:
            _old, old_meta = self._gpu.popitem(last=False)
            self.num_evicted += 1
            self._emit(BlockRemoved((engine_hash_of(old_meta),), Medium.GPU, self.group_idx))

    def _stored(self, meta: BlockMeta, medium: Medium) -> BlockStored:
        """The checkpoint as vLLM's Mamba group publishes a kept state: one block, its parent and tokens (GPU and
        the shared pool, which another worker may resolve without this worker's GPU store), or the bare hash for
        the CPU tier (resolved through the GPU store of the same block)."""
        if medium is Medium.CPU:
            return BlockStored(
                (engine_hash_of(meta),), None, (), self.block_size, medium, None, None, self.group_idx, SpecKind.MAMBA
            )
        extra = ((meta.cache_salt,),) if meta.cache_salt and meta.depth == 0 else None
        return BlockStored(
            (engine_hash_of(meta),),
            None if meta.parent_block_hash is None else to_engine_hash(meta.parent_block_hash),
            meta.token_ids,
            self.block_size,
            medium,
            meta.lora_name,
            extra,
            self.group_idx,
            SpecKind.MAMBA,
        )

    def _add_costs(self, **counts: int) -> None:
        c = self._costs
        self._costs = msgspec.structs.replace(c, **{k: getattr(c, k) + v for k, v in counts.items()})

    def take_costs(self) -> CheckpointCosts:
        """Copies made since the last call (swapped out)."""
        costs, self._costs = self._costs, CheckpointCosts()
        return costs

    def snapshot_events(self) -> list[KVEvent]:
        """The kept checkpoints as stores (after the main group's snapshot, whose stores resolve CPU ones)."""
        events: list[KVEvent] = [self._stored(m, Medium.GPU) for m in self._gpu.values()]
        events.extend(self._stored(m, Medium.CPU) for m in self._cpu.values())
        events.extend(self._stored(m, Medium.MOONCAKE) for m in self._pool_known.values())
        return events

    def reset(self) -> None:
        """Forget every checkpoint (``reset_prefix_cache``; the manager emits ``AllBlocksCleared``); the shared
        pool keeps its copies (one worker does not clear it), this worker forgets what it announced there."""
        self._gpu.clear()
        self._cpu.clear()
        self._pool_known.clear()
        self._staged.clear()


class HybridGroups:
    """The groups beyond group 0, built from ``kv-cache.groups`` (empty for a full-attention model).

    Args:
        groups: the configured groups (index = ``group_idx``; group 0 is the manager's own pool).
        checkpoints: checkpoint policy of recurrent groups.
        block_size: tokens per block.
        num_gpu_blocks: the main pool's size (default size of sliding-window pools).
        emit: where KV events go (the manager's queue).
        pool: the shared pool's store, where recurrent checkpoints are written through (``None``: no pool).
    """

    def __init__(
        self,
        groups: Sequence[CacheGroupConfig],
        checkpoints: CheckpointConfig,
        block_size: int,
        num_gpu_blocks: int,
        emit: Callable[[KVEvent], None],
        pool: PoolStore | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding: list[SlidingWindowGroup] = []
        self.recurrent: list[RecurrentGroup] = []
        for group_idx, group in enumerate(groups):
            if group_idx == 0:
                continue
            if group.kind == "sliding_window":
                assert group.sliding_window_tokens is not None  # (validated by the config)
                self.sliding.append(
                    SlidingWindowGroup(
                        group_idx,
                        group.num_gpu_blocks or num_gpu_blocks,
                        block_size,
                        group.sliding_window_tokens,
                        emit,
                    )
                )
            elif group.kind == "recurrent":
                self.recurrent.append(
                    RecurrentGroup(group_idx, block_size, group.state_bytes, checkpoints, emit, pool)
                )
        self.is_hybrid = bool(self.sliding or self.recurrent)

    def usable_blocks(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """The largest ``L <= max_blocks`` every group can serve (group 0 serves ``max_blocks``)."""
        if not self.is_hybrid or max_blocks == 0:
            return max_blocks
        ok = [True] * (max_blocks + 1)
        per_group = [g.usable(hashes, max_blocks) for g in self.sliding]
        per_group.extend(g.usable(hashes, max_blocks) for g in self.recurrent)
        for usable in per_group:
            ok = [a and b for a, b in zip(ok, usable, strict=True)]
        return max(i for i, flag in enumerate(ok) if flag)

    def fetch_checkpoints(self, hashes: Sequence[BlockHash], num_hit_blocks: int) -> bool:
        """Read from the shared pool every recurrent group's checkpoint at block ``num_hit_blocks - 1`` that no
        local tier holds; False when one can no longer be read (the caller shortens the hit)."""
        if num_hit_blocks == 0:
            return True
        return all(g.fetch_from_pool(hashes[num_hit_blocks - 1]) for g in self.recurrent)

    def on_pool_evict(self, keys: Sequence[str]) -> None:
        """The shared pool evicted ``keys`` (blocks and checkpoints alike; each group picks its own)."""
        for recurrent in self.recurrent:
            recurrent.on_pool_evict(keys)

    def can_admit(self, hashes: Sequence[BlockHash], num_hit_blocks: int, num_tokens: int) -> bool:
        """Whether every sliding-window pool can give the sequence its blocks."""
        return all(g.can_admit(hashes, num_hit_blocks, num_tokens) for g in self.sliding)

    def admit(
        self,
        request_id: str,
        hashes: Sequence[BlockHash],
        num_hit_blocks: int,
        num_tokens: int,
        last_hit_meta: BlockMeta | None,
    ) -> None:
        """Give a sequence its per-group state for a hit of ``num_hit_blocks`` (``can_admit`` was true)."""
        for sliding in self.sliding:
            sliding.admit(request_id, hashes, num_hit_blocks, num_tokens)
        for recurrent in self.recurrent:
            recurrent.resume(request_id, hashes, num_hit_blocks, last_hit_meta)

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        """Whether every sliding-window pool can extend the sequence to ``num_tokens``."""
        return all(g.num_blocks_to_grow(request_id, num_tokens) <= g.pool.num_free_blocks for g in self.sliding)

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Extend the sequence's sliding-window tables (``can_grow`` was true)."""
        for sliding in self.sliding:
            sliding.grow(request_id, num_tokens)

    def cache_computed(
        self, request_id: str, metas: Sequence[BlockMeta], num_computed_tokens: int, num_prompt_tokens: int
    ) -> None:
        """New full blocks ``metas`` were computed (consecutive, from the first not yet seen by the groups)."""
        for sliding in self.sliding:
            sliding.cache_computed(request_id, metas, num_computed_tokens)
        for recurrent in self.recurrent:
            recurrent.on_computed(request_id, metas, num_prompt_tokens)

    def end_turn(self, request_id: str) -> None:
        """The request finished normally: generation-end checkpoints."""
        for recurrent in self.recurrent:
            recurrent.end_turn(request_id)

    def free(self, request_id: str) -> None:
        """Release the sequence's per-group state."""
        for sliding in self.sliding:
            sliding.free(request_id)
        for recurrent in self.recurrent:
            recurrent.free(request_id)

    def take_costs(self) -> CheckpointCosts:
        """Recurrent-state copies of every recurrent group since the last call, summed."""
        total = CheckpointCosts()
        for recurrent in self.recurrent:
            c = recurrent.take_costs()
            total = CheckpointCosts(
                *(getattr(total, f) + getattr(c, f) for f in CheckpointCosts.__struct_fields__)
            )
        return total

    def snapshot_events(self) -> list[KVEvent]:
        """Every group's cached blocks and checkpoints as stores (after the main group's)."""
        events: list[KVEvent] = []
        for sliding in self.sliding:
            events.extend(
                _tag(e, sliding.group_idx, SpecKind.SLIDING_WINDOW, sliding.window_tokens)
                for e in stored_events(sliding.pool.cached_metas(), self.block_size, Medium.GPU)
            )
        for recurrent in self.recurrent:
            events.extend(recurrent.snapshot_events())
        return events

    def reset(self) -> bool:
        """Drop every group's cache; False (nothing changed) while a sliding-window block is in use."""
        if not all(g.pool.num_free_blocks == g.pool.num_blocks for g in self.sliding):
            return False
        for sliding in self.sliding:
            sliding.pool.reset()
        for recurrent in self.recurrent:
            recurrent.reset()
        return True
