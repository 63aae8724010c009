"""A worker's pool stores published under its engine's own medium (vLLM's Mooncake store connector: ``cpu``) are
pool entries every member of the pool reaches; config errors; the pure rewrite."""

from __future__ import annotations

import pytest

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Medium
from router.block_hash import hash_token_blocks
from router.config import parse_config
from router.gateway import Gateway
from router.pool_media import to_pool_medium
from router.transport import MockResponse, MockTransport, UpstreamRequest
from tests.router.harness import wait_until

TOKENS = list(range(64))


def cpu_stored() -> BlockStored:
    return BlockStored(block_hashes=(11, 12, 13, 14), parent_block_hash=None, token_ids=tuple(TOKENS),
                       block_size=16, medium=Medium.CPU)  # fmt: skip


def batch(worker_id: str, seq: int, *events) -> EventBatch:
    return EventBatch(worker_id=worker_id, dp_rank=0, seq=seq, ts_s=0.0, events=events)


def worker(worker_id: str, port: int, **extra) -> dict:
    return {"id": worker_id, "url": f"http://127.0.0.1:{port}", "model": "m",
            "events_endpoint": f"tcp://127.0.0.1:{port}", **extra}  # fmt: skip


def test_the_rewrite_moves_only_the_named_media():
    clear_all = AllBlocksCleared()
    events = (
        cpu_stored(),
        BlockRemoved(block_hashes=(14,), medium=Medium.CPU),
        BlockRemoved(block_hashes=(1,), medium=Medium.GPU),
        AllBlocksCleared(medium=Medium.CPU),
        clear_all,
    )
    out = to_pool_medium(batch("a", 0, *events), frozenset({Medium.CPU}))
    assert [getattr(e, "medium", None) for e in out.events] == [
        Medium.MOONCAKE,
        Medium.MOONCAKE,
        Medium.GPU,
        Medium.MOONCAKE,
        None,
    ]
    assert out.events[0].token_ids == tuple(TOKENS) and out.events[1].block_hashes == (14,)
    same = batch("a", 1, events[2])
    assert to_pool_medium(same, frozenset({Medium.CPU})) is same


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"pool_event_media": ["CPU"]}, "pool_event_media needs pools"),
     ({"pools": ["MOONCAKE"], "pool_event_media": ["GPU"]}, "'GPU' is not a medium"),
     ({"pools": ["MOONCAKE"], "pool_event_media": ["tape"]}, "'tape' is not a medium")],
)  # fmt: skip
def test_config_errors(extra, message):
    with pytest.raises(Exception, match=message):
        parse_config({"models": [{"name": "m", "block_size": 16}], "workers": [worker("a", 9, **extra)],
                      "admin": {"disable_auth": True}})  # fmt: skip


async def test_a_cpu_store_of_one_member_is_a_pool_hit_for_every_member_and_not_for_others():
    async def handler(request: UpstreamRequest) -> MockResponse:
        return MockResponse(404, {}, [b""])  # vLLM serves no snapshot

    pooled = {"pools": ["MOONCAKE"], "pool_event_media": ["cpu"]}
    config = parse_config({
        "models": [{"name": "m", "block_size": 16}],
        "workers": [worker("a", 9, **pooled), worker("b", 10, **pooled), worker("c", 11)],
        "admin": {"disable_auth": True},
    })  # fmt: skip
    gw = Gateway(config, transport=MockTransport(handler))
    runtimes = [await gw.add_worker(w) for w in config.workers]
    other = BlockStored(block_hashes=(99,), parent_block_hash=None, token_ids=tuple(range(500, 516)), block_size=16)
    gw.events.on_event(batch("b", 0, other))  # b's own GPU block: b has a slot in the index
    gw.events.on_event(batch("a", 0, cpu_stored()))
    gw.events.on_event(batch("c", 0, cpu_stored()))  # c's own CPU tier: no pool
    await wait_until(lambda: all(r.is_warm for r in runtimes))
    match = gw.indexes["m"].match(hash_token_blocks(TOKENS + [0], 16)).workers
    got = {w: (m.num_gpu_blocks, m.num_cpu_blocks, m.num_pool_blocks) for w, m in match.items()}
    assert got == {"a": (0, 0, 4), "b": (0, 0, 4), "c": (0, 4, 0)}
    # a removal on the engine's medium leaves the pool (the watcher's job where the engine sends none)
    gw.events.on_event(batch("a", 1, BlockRemoved(block_hashes=(13, 14), medium=Medium.CPU)))
    match = gw.indexes["m"].match(hash_token_blocks(TOKENS + [0], 16)).workers
    assert {w: m.num_pool_blocks for w, m in match.items()} == {"a": 2, "b": 2, "c": 0}
    await gw.events.cancel_warmups()
