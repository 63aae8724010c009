"""The pool's use order: which existence checks tell a Mooncake master that objects were used.

A ``mooncake_master`` past its high watermark evicts the objects whose lease ran out earliest (``BatchEvict``,
``mooncake-store/src/master_service.cpp``), and grants a lease on ``ExistKey`` / ``GetReplicaList`` only, never on
a put (``../shared/reference/mooncake-vllm-triton.md``, measured). Its eviction order follows the last existence
check or read, then, and two uses of a block would never reach it:

* a block served from GPU or CPU: the worker reads nothing from the pool, so a session that keeps hitting on one
  worker's GPU leaves its pool copy the oldest in the pool, evicted while the session is live (LMCache's vLLM
  connector has the use reach the pool anyway: its ``get_num_new_matched_tokens`` looks up the whole prompt, from
  its first token, whatever vLLM's own prefix cache holds, ``lmcache/integration/vllm/vllm_v1_adapter.py``);
* a block just put: it ranks with the never-used objects, the first to go.

So each is followed by one batched existence check whose answer is not needed (``PoolTier.refresh``, and the
write thread's ``put_as_used``).
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.kv.hashing import BlockHash
from workers.kv.pool_chunk import HostBuffer
from workers.kv.pool_spans import lookup_objects
from workers.kv.pool_store import PoolStore


def used_keys(hashes: Sequence[BlockHash], end: int, span_len: int) -> list[str]:
    """The keys of the objects holding the chain's first ``end`` blocks (spans, then the tail's singles)."""
    if end <= 0:
        return []
    spans, singles = lookup_objects(hashes, 0, min(end, len(hashes)), span_len)
    return [o.key for o in spans] + [o.key for o in singles]


def put_as_used(
    store: PoolStore, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
) -> list[bool]:
    """``store.put_from``, then one existence check of the objects put (module docstring); per key, whether it was
    put."""
    ok = store.put_from(keys, buffer, offsets, sizes)
    put = [k for k, done in zip(keys, ok, strict=True) if done]
    if put:
        store.exists(put)
    return ok
