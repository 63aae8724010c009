"""Benchmark: decode + normalize throughput of KV event batches, against plain msgspec decoding.

Run ``python -m benchmarks.events``. Builds realistic batches (default 64 BlockStored events x 32 blocks x 16 tokens,
u64 hashes, vLLM's current wire shape, plus the legacy all-array shape and SGLang-style signed hashes), then times,
in the same process and on the same bytes:

    baseline   msgspec.msgpack.decode(payload)                  (untyped, no validation)
    ours       EventDecoder.decode(payload, ...)               (typed decode, fold, validate, build structs)

and prints blocks/s for each and the ratio ours / baseline (target: >= 1,000,000 blocks/s and >= 0.5).
Timing is the best of ``--repeat`` rounds of ``--iterations`` decodes (``time.perf_counter``).
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from events.counters import EventCounters
from events.decode import EventDecoder
from events.encode import WireShape, encode_batch
from events.types import BlockStored, EngineBlockHash


def make_events(
    num_events: int, num_blocks: int, block_size: int, seed: int = 0, signed: bool = False
) -> list[BlockStored]:
    """Builds a prefix-chained run of GPU BlockStored events with random u64 hashes and token ids."""
    rng = random.Random(seed)
    events: list[BlockStored] = []
    parent: EngineBlockHash | None = None
    for _ in range(num_events):
        hashes = tuple(EngineBlockHash(rng.getrandbits(64)) for _ in range(num_blocks))
        events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tuple(rng.randrange(150_000) for _ in range(num_blocks * block_size)),
                block_size=block_size,
                extra_keys=(None,) * num_blocks,
                kv_cache_spec_kind="full_attention",
            )
        )
        parent = hashes[-1]
    return events


def _best_s(fn: Callable[[], Any], iterations: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, (time.perf_counter() - start) / iterations)
    return best


def _signed_payload(events: list[BlockStored]) -> bytes:
    """The same batch with hashes sent as signed int64 (SGLang style) in tagged arrays."""
    wire = []
    for e in events:
        to_i64 = [h - (1 << 64) if h >= 1 << 63 else h for h in e.block_hashes]
        parent = e.parent_block_hash
        wire.append(
            ["BlockStored", to_i64, None if parent is None else parent - (1 << 64) if parent >= 1 << 63 else parent,
             list(e.token_ids), e.block_size, None, "GPU"]
        )
    return msgspec.msgpack.encode([1.0, wire, 0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=64, help="BlockStored events per batch")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per event")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--iterations", type=int, default=100, help="decodes per timing round")
    parser.add_argument("--repeat", type=int, default=5, help="timing rounds (best is kept)")
    args = parser.parse_args(argv)
    events = make_events(args.events, args.blocks, args.block_size)
    num_blocks = args.events * args.blocks
    shapes: list[tuple[str, bytes]] = []
    wire_shapes: tuple[WireShape, ...] = ("vllm", "vllm-legacy")
    for wire_shape in wire_shapes:
        shapes.append((wire_shape, encode_batch(events, 1.0, 0, wire_shape)))
    shapes.append(("sglang-signed", _signed_payload(events)))
    print(
        f"batch: {args.events} events x {args.blocks} blocks x {args.block_size} tokens = {num_blocks} blocks; "
        f"best of {args.repeat} x {args.iterations}"
    )
    print(f"{'shape':<14} {'bytes':>9} {'plain blocks/s':>15} {'ours blocks/s':>15} {'ours/plain':>10}")
    for name, payload in shapes:
        counters = EventCounters()
        decoder = EventDecoder(counters)
        check = decoder.decode(payload, worker_id="bench", seq=0, block_size=args.block_size)
        if check is None or len(check.events) != args.events or counters.total_drops():
            raise RuntimeError(f"{name}: decoder refused the benchmark batch: {dict(counters.drops)}")
        plain_s = _best_s(functools.partial(msgspec.msgpack.decode, payload), args.iterations, args.repeat)
        ours = functools.partial(decoder.decode, payload, worker_id="bench", seq=0, block_size=args.block_size)
        ours_s = _best_s(ours, args.iterations, args.repeat)
        print(
            f"{name:<14} {len(payload):>9} {num_blocks / plain_s:>15,.0f} {num_blocks / ours_s:>15,.0f} "
            f"{plain_s / ours_s:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
