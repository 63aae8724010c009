"""A worker's snapshot is applied only for a dp rank the worker was configured with (as live batches are)."""

from __future__ import annotations

import logging

import pytest

from events.encode import encode_batch
from events.types import BlockStored
from router.block_hash import hash_token_blocks
from router.config import parse_config
from router.fleet import WorkerRuntime
from router.gateway import Gateway
from router.transport import MockResponse, MockTransport, UpstreamRequest

TOKENS = list(range(64))


def _snapshot(dp_rank: int) -> bytes:
    stored = BlockStored(block_hashes=(1, 2, 3, 4), parent_block_hash=None, token_ids=tuple(TOKENS), block_size=16)
    return encode_batch([stored], 0.0, dp_rank)


@pytest.mark.parametrize(("dp_rank", "applied"), [(0, True), (3, False)])
async def test_snapshot_of_an_unconfigured_rank_is_refused(dp_rank: int, applied: bool, caplog) -> None:
    async def handler(request: UpstreamRequest) -> MockResponse:
        return MockResponse(200, {"x-kvgate-last-seq": "7"}, [_snapshot(dp_rank)])

    config = parse_config({
        "models": [{"name": "m", "block_size": 16}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "model": "m", "events_endpoint": "tcp://127.0.0.1:9"}],
        "admin": {"disable_auth": True},
    })
    gw = Gateway(config, transport=MockTransport(handler))
    worker = WorkerRuntime(config.workers[0], 16, config.circuit_breaker)
    with caplog.at_level(logging.WARNING, logger="router.event_path"):
        last_seq = await gw.events.warm_from_snapshot(worker, gw.indexes["m"])
    held = gw.indexes["m"].match(hash_token_blocks(TOKENS, 16)).workers
    if applied:
        assert last_seq == 7 and held["w0"].num_gpu_blocks == 4
    else:
        assert last_seq is None and held == {}
        assert [r.getMessage() for r in caplog.records] == [
            "worker w0: snapshot of dp rank 3 refused (the worker has 1)"]
