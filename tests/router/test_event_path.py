"""The event path (``router.event_path``) on a real gateway's components, without sockets: live batches around a
snapshot the worker serves through a ``MockTransport``, a resync, and a removed worker's batches."""

from __future__ import annotations

import asyncio

from events.encode import encode_batch
from events.types import BlockStored, EventBatch, Resync
from router.block_hash import hash_token_blocks
from router.config import parse_config
from router.gateway import Gateway
from router.transport import MockResponse, MockTransport, UpstreamRequest
from tests.router.harness import wait_until

TOKENS = list(range(128))


def stored(first_block: int, num_blocks: int) -> BlockStored:
    """Blocks ``first_block..first_block + num_blocks - 1`` of ``TOKENS`` (engine hashes 1, 2, ...)."""
    hashes = tuple(range(first_block + 1, first_block + num_blocks + 1))
    return BlockStored(block_hashes=hashes, parent_block_hash=first_block or None,
                       token_ids=tuple(TOKENS[16 * first_block:16 * (first_block + num_blocks)]), block_size=16)


def live(seq: int, *events: BlockStored) -> EventBatch:
    return EventBatch(worker_id="w0", dp_rank=0, seq=seq, ts_s=0.0, events=events)


def gpu_blocks(gw: Gateway) -> int:
    held = gw.indexes["m"].match(hash_token_blocks(TOKENS, 16)).workers
    return held["w0"].num_gpu_blocks if "w0" in held else 0


def gateway(handler) -> Gateway:
    config = parse_config({
        "models": [{"name": "m", "block_size": 16}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "model": "m", "events_endpoint": "tcp://127.0.0.1:9"}],
        "admin": {"disable_auth": True},
    })
    return Gateway(config, transport=MockTransport(handler))


async def test_batches_held_during_the_snapshot_fetch_are_spliced_by_seq():
    release = asyncio.Event()
    fetched: list[str] = []

    async def handler(request: UpstreamRequest) -> MockResponse:
        fetched.append(request.base_url + request.path)
        await release.wait()  # live batches arrive while the snapshot is on its way
        return MockResponse(200, {"x-kvgate-last-seq": "1"}, [encode_batch([stored(0, 4)], 0.0, 0)])

    gw = gateway(handler)
    worker = gw.fleet.add(gw.config.workers[0])
    gw.events.add_worker(worker)
    await wait_until(lambda: fetched == ["http://127.0.0.1:9/kv/snapshot"])
    gw.events.on_event(live(1, stored(0, 2)))  # in the snapshot: dropped
    gw.events.on_event(live(2, stored(4, 4)))  # the next one: applied after it
    assert gpu_blocks(gw) == 0 and not worker.is_warm
    release.set()
    await wait_until(lambda: worker.is_warm)
    assert gpu_blocks(gw) == 8
    gw.events.on_event(live(3, stored(0, 1)))
    assert gw.indexes["m"].stats().counters["num_batches"] == 3  # the snapshot, seq 2, seq 3: seq 1 never
    await gw.events.cancel_warmups()


async def test_without_a_snapshot_held_batches_are_applied_and_a_resync_starts_over():
    async def handler(request: UpstreamRequest) -> MockResponse:
        return MockResponse(404, {}, [b""])  # vLLM serves no snapshot

    gw = gateway(handler)
    worker = gw.fleet.add(gw.config.workers[0])
    gw.events.add_worker(worker)
    assert gw.events.index_of("w0") is gw.indexes["m"]
    gw.events.on_event(live(0, stored(0, 8)))  # held until the snapshot endpoint answers
    assert gpu_blocks(gw) == 0
    await wait_until(lambda: worker.is_warm)
    assert gpu_blocks(gw) == 8 and not worker.is_approximate
    gw.events.on_event(Resync(worker_id="w0", reason="seq_backwards"))
    assert gpu_blocks(gw) == 0 and not worker.is_warm and worker.is_approximate
    gw.events.on_event(live(0, stored(0, 4)))
    await wait_until(lambda: worker.is_warm)
    assert gpu_blocks(gw) == 4
    gw.fleet.remove("w0")
    await gw.events.remove_worker("w0")
    assert gw.events.index_of("w0") is None
    gw.events.on_event(live(1, stored(4, 4)))
    assert gpu_blocks(gw) == 0
