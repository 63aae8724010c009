"""Pool stores an engine publishes under one of its own media, applied to the index as the shared pool tier.

vLLM's ``MooncakeStoreConnector`` publishes every block it writes to the Mooncake pool as ``BlockStored`` with
``medium="cpu"`` (and the block's ``group_idx``) once ``batch_put_from_multi_buffers`` returns, and never a
``BlockRemoved``: its sending thread keeps only ``BlockStored`` events (vllm-project/vllm,
``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py``, ``KVCacheStoreSendingThread``, commit
``003df2961dd8``). Read as they are, those blocks would be priced as the worker's own CPU tier, out of reach of the
other workers on the same pool. A worker's ``pool_event_media`` (``router.worker_config``) names such media; its
events on them are rewritten here to ``Medium.MOONCAKE`` before the splice and the index, so they become pool
entries every member of the pool reaches (``PrefixIndex.set_pool_members``)::

    BlockStored(medium=CPU)      -> BlockStored(medium=MOONCAKE)
    BlockRemoved(medium=CPU)     -> BlockRemoved(medium=MOONCAKE)
    AllBlocksCleared(medium=CPU) -> AllBlocksCleared(medium=MOONCAKE)    (a clear of every tier stays as it is)

A worker that names CPU here has no CPU tier of its own in the index (an engine publishing both on CPU could not
be told apart).
"""

from __future__ import annotations

import msgspec

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent, Medium


def to_pool_medium(batch: EventBatch, media: frozenset[Medium]) -> EventBatch:
    """``batch`` with the events on ``media`` moved to ``Medium.MOONCAKE`` (module docstring); the same object
    when none is."""
    if not media:
        return batch
    events: list[KVEvent] | None = None
    for i, event in enumerate(batch.events):
        if isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared) and event.medium in media:
            if events is None:
                events = list(batch.events)
            events[i] = msgspec.structs.replace(event, medium=Medium.MOONCAKE)
    if events is None:
        return batch
    return msgspec.structs.replace(batch, events=tuple(events))
