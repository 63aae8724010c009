"""An external data-parallel vLLM rank run as its own server (``dp_ranks: 1``, batches with ``data_parallel_rank:
k``) is a worker with ``dp_rank_offset: k``: its events are indexed under rank ``k``; without the offset they are
dropped as ``unknown_dp_rank`` (real ZMQ on loopback)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from events.counters import DropKind
from events.publisher import KVEventPublisher, PublisherConfig
from events.types import BlockStored
from router.block_hash import hash_token_blocks
from router.config import decode_worker
from router.errors import ConfigError
from tests.router.harness import BLOCK_SIZE, GatewayHarness, make_config

TOKENS = list(range(3 * BLOCK_SIZE))


@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.parametrize(("dp_rank_offset", "is_indexed"), [(3, True), (0, False)])
async def test_an_external_dp_rank_is_indexed_under_its_rank(dp_rank_offset: int, is_indexed: bool) -> None:
    publisher = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", dp_rank=3, linger_s=0.0))
    try:
        worker = decode_worker({
            "id": "rank3", "url": "http://127.0.0.1:9", "model": "m", "events_endpoint": publisher.endpoint,
            "dp_ranks": 1, "dp_rank_offset": dp_rank_offset, "load_path": None, "snapshot_path": None})
        config = msgspec.structs.replace(make_config([]), workers=(worker,))
        async with GatewayHarness(config) as h:
            counters = h.gw.subscriber.counters
            async with asyncio.timeout(10):  # ZMQ slow joiner: empty batches until one arrives (or is dropped)
                while (h.gw.subscriber.last_seq("rank3", dp_rank=3) is None
                       and counters.drops_by_kind().get(DropKind.UNKNOWN_DP_RANK, 0) == 0):
                    publisher.publish([])
                    await asyncio.sleep(0.02)
            hashes = [int.from_bytes(bytes([i]) * 8, "big") for i in range(1, 4)]
            publisher.publish([BlockStored(block_hashes=tuple(hashes), parent_block_hash=None,
                                           token_ids=tuple(TOKENS), block_size=BLOCK_SIZE)])
            index = h.gw.indexes["m"]
            query = hash_token_blocks(TOKENS, BLOCK_SIZE)
            if is_indexed:
                async with asyncio.timeout(10):
                    while "rank3" not in index.match(query).workers:
                        await asyncio.sleep(0.01)
                match = index.match(query).workers["rank3"]
                assert (match.dp_rank, match.num_gpu_blocks) == (3, 3)
                assert counters.total_drops() == 0
            else:
                async with asyncio.timeout(10):
                    while counters.drops_by_kind().get(DropKind.UNKNOWN_DP_RANK, 0) < 2:
                        publisher.publish([])
                        await asyncio.sleep(0.02)
                assert index.match(query).workers == {}
    finally:
        publisher.close()


def test_dp_rank_offset_is_checked_and_gives_the_worker_its_ranks() -> None:
    base = {"id": "w", "url": "http://127.0.0.1:9", "model": "m", "events_endpoint": "tcp://127.0.0.1:6000"}
    assert list(decode_worker({**base, "dp_ranks": 2, "dp_rank_offset": 4}).dp_rank_range) == [4, 5]
    assert list(decode_worker(base).dp_rank_range) == [0]
    with pytest.raises(ConfigError, match="dp_rank_offset"):
        decode_worker({**base, "dp_rank_offset": -1})
