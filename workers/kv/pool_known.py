"""What a worker knows of the shared pool's objects: which objects hold which of its blocks, so that it announces
a block (``BlockStored`` / ``BlockRemoved``, MOONCAKE) once however many objects hold it (``workers.kv.pool_tier``:
a block is in its single object and in the spans of every chain through it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from workers.kv.block_pool import BlockMeta
from workers.kv.hashing import BlockHash

__all__ = ["KnownObjects"]


class KnownObjects:
    """Pool objects a worker knows of (key -> the member blocks it knows, chain order), oldest first, and per block
    how many of those objects hold it: a block is known while one does (refcount; its single and its spans).

    Invariants: ``_refs[h]`` is the number of entries of ``objects`` listing block ``h`` (each lists a block at most
    once), never 0; ``_metas`` has exactly the keys of ``_refs``. Eviction order (``pop_oldest``): the object known
    longest ago first (``add`` of a known key moves it to the newest end).
    """

    __slots__ = ("objects", "_metas", "_refs")

    def __init__(self) -> None:
        self.objects: OrderedDict[str, tuple[BlockMeta, ...]] = OrderedDict()
        self._metas: dict[BlockHash, BlockMeta] = {}
        self._refs: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by the known objects."""
        return len(self._refs)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._refs

    def metas(self) -> list[BlockMeta]:
        """Each known block once, in the order it became known."""
        return list(self._metas.values())

    def add(self, key: str, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """Know ``key`` holds ``metas`` (added to the members known already, moved to the newest end); the blocks
        that were not known before."""
        old = self.objects.pop(key, None)
        if old is None:
            extra: Sequence[BlockMeta] = metas
            self.objects[key] = tuple(metas)
        else:
            have = {m.block_hash for m in old}
            extra = [m for m in metas if m.block_hash not in have]
            self.objects[key] = (*old, *extra)
        new: list[BlockMeta] = []
        refs = self._refs
        for m in extra:
            n = refs.get(m.block_hash, 0)
            refs[m.block_hash] = n + 1
            if not n:
                self._metas[m.block_hash] = m
                new.append(m)
        return new

    def forget(self, key: str) -> list[BlockMeta]:
        """Forget ``key``; the blocks no known object holds any more."""
        return self._release(self.objects.pop(key, ()))

    def pop_oldest(self) -> None:
        self._release(self.objects.popitem(last=False)[1])

    def _release(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        gone: list[BlockMeta] = []
        refs = self._refs
        for m in metas:
            n = refs[m.block_hash] - 1
            if n:
                refs[m.block_hash] = n
            else:
                del refs[m.block_hash]
                del self._metas[m.block_hash]
                gone.append(m)
        return gone

    def clear(self) -> None:
        self.objects.clear()
        self._metas.clear()
        self._refs.clear()
