"""A block's pieces (one per layer group) go into the pool as one chunk: one object, kept or evicted whole, and a
read that finds any piece missing or altered restores none of the block (never a partial load)."""

from __future__ import annotations

import pytest

from events.types import BlockRemoved, Medium
from workers.config import KVCacheConfig, PoolConfig
from workers.kv import pool_zero
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_chunk import HEAD_BYTES, ChunkLayout, HostBuffer
from workers.kv.pool_tier import SimPool, pool_key

pytestmark = pytest.mark.unit

BS = 4
GROUPS = 4
VALUE_BYTES = 1024
TOKENS = [300 + i for i in range(4 * BS)]


def test_layout_sizes_and_a_built_chunk_checks_out():
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    assert layout.header_bytes == HEAD_BYTES + 8 * GROUPS == 80
    assert layout.chunk_bytes == VALUE_BYTES and layout.piece_bytes == (VALUE_BYTES - 80) // GROUPS == 236
    (h,) = extend_block_hashes([], namespace_root(), TOKENS[:BS], BS)
    chunk = bytearray(layout.build(h, TOKENS[:BS]))
    assert len(chunk) == VALUE_BYTES and chunk[:4] == b"KVGC" and chunk[16:48] == h
    for g in range(GROUPS):  # every layer group's piece carries the block's tokens (the sim payload)
        at = 80 + g * 236
        assert chunk[at : at + 16] == b"".join(t.to_bytes(4, "little") for t in TOKENS[:BS])
    assert layout.check(chunk, 0, len(chunk), h, TOKENS[:BS])
    assert not layout.check(chunk, 0, len(chunk), h, TOKENS[1 : BS + 1])  # another block's tokens
    assert not layout.check(chunk, 0, len(chunk) - 236, h, TOKENS[:BS])  # a read short of the last piece
    assert ChunkLayout(BS, 1, 0).chunk_bytes == HEAD_BYTES + 8 + 4 * BS  # no padding: manifest + tokens


@pytest.mark.parametrize("position", [0, 5, 20, 50, 80, 95, 200, 316, 552, 800, 1000, 1023])
def test_one_altered_byte_anywhere_makes_the_chunk_a_miss(position: int):
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    (h,) = extend_block_hashes([], namespace_root(), TOKENS[:BS], BS)
    chunk = bytearray(layout.build(h, TOKENS[:BS]))
    chunk[position] ^= 0x40
    assert not layout.check(chunk, 0, len(chunk), h, TOKENS[:BS])
    assert layout.check(chunk, 0, len(chunk), h, TOKENS[:BS], check_padding=False) == (
        position >= 80 and (position - 80) % 236 >= 16
    )  # without the padding check: the manifest and every payload are still checked


def test_a_chunk_written_in_a_reused_slot_is_identical():
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    hashes = extend_block_hashes([], namespace_root(), TOKENS, BS)
    buffer = HostBuffer(2 * VALUE_BYTES)
    layout.write(buffer.view, VALUE_BYTES, hashes[0], TOKENS[:BS])
    layout.write(buffer.view, VALUE_BYTES, hashes[1], TOKENS[BS : 2 * BS])  # the slot's next job
    assert bytes(buffer.data[VALUE_BYTES:]) == layout.build(hashes[1], TOKENS[BS : 2 * BS])
    assert bytes(buffer.data[:VALUE_BYTES]) == bytes(VALUE_BYTES)


def make_worker(pool: SimPool) -> KVCacheManager:
    holder: list[KVCacheManager] = []
    client = pool.attach(lambda keys: holder[0]._on_pool_evict(keys))
    config = KVCacheConfig(num_gpu_blocks=16, block_size=BS, pool=PoolConfig(
        backend="sim", value_bytes_per_block=VALUE_BYTES, num_layer_groups=GROUPS))  # fmt: skip
    holder.append(KVCacheManager(config, pool_store=client))
    return holder[0]


def store_prompt(kv: KVCacheManager, tokens: list[int]) -> SequenceKV:
    seq = SequenceKV("a")
    assert kv.admit(seq, kv.find_prefix(seq, tokens, len(tokens)), len(tokens))
    kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    (store,), _ = kv.take_pool_copies()
    kv.complete_store(store.job_id)
    kv.take_events()
    return seq


def restore(kv: KVCacheManager, tokens: list[int]) -> tuple[int, int]:
    """(blocks the lookup found in the pool, blocks restored)."""
    seq = SequenceKV("b")
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert kv.admit(seq, hit, len(tokens))
    return hit.num_pool_blocks, seq.num_cached_blocks


def test_every_layer_group_of_a_block_is_one_pool_object():
    pool = SimPool(64)
    a, b = make_worker(pool), make_worker(pool)
    seq = store_prompt(a, TOKENS + [1])
    assert pool.keys() == [pool_key(h) for h in seq.block_hashes]  # 4 blocks x 4 groups: 4 objects, not 16
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    assert [pool._data[pool_key(h)][0] for h in seq.block_hashes] == [
        layout.build(h, TOKENS[i * BS : (i + 1) * BS]) for i, h in enumerate(seq.block_hashes)
    ]
    assert restore(b, TOKENS + [1]) == (4, 4)


def test_a_block_evicted_by_the_pool_goes_with_all_its_layer_groups():
    pool = SimPool(64)
    a, b = make_worker(pool), make_worker(pool)
    seq = store_prompt(a, TOKENS + [1])
    pool.evict([pool_key(seq.block_hashes[2])])
    assert len(pool) == 3
    (removed,) = a.take_events()
    assert removed == BlockRemoved(block_hashes=(to_engine_hash(seq.block_hashes[2]),), medium=Medium.MOONCAKE)
    assert restore(b, TOKENS + [1]) == (2, 2)  # blocks 0 and 1; block 2 (and so 3) is computed, all of it
    assert b.pool is not None and b.pool.num_fetch_mismatches == 0


@pytest.mark.parametrize("damage", ["last_piece_missing", "one_piece_zeroed", "manifest_names_3_groups"])
def test_a_chunk_lacking_one_layer_group_is_a_miss_never_a_partial_load(damage: str):
    pool = SimPool(64)
    a, b = make_worker(pool), make_worker(pool)
    seq = store_prompt(a, TOKENS + [1])
    key = pool_key(seq.block_hashes[1])
    value, owner = pool._data[key]
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    piece = layout.header_bytes + (GROUPS - 1) * layout.piece_bytes
    if damage == "last_piece_missing":  # what a writer that lost one group's piece would leave
        bad = value[:piece]
    elif damage == "one_piece_zeroed":
        bad = value[:piece] + bytes(len(value) - piece)
    else:
        bad = value[:5] + bytes([GROUPS - 1]) + value[6:]
    pool._data[key] = (bad, owner)
    assert restore(b, TOKENS + [1]) == (4, 1)  # the lookup sees 4 objects; only block 0 is restored
    assert b.pool is not None and (b.pool.num_fetch_mismatches, b.pool.num_blocks_fetched) == (1, 1)
    assert key not in pool._data  # the damaged chunk is dropped from the pool: nobody reads it again
    (removed,) = a.take_events()  # and its writer tells the gateway
    assert removed == BlockRemoved(block_hashes=(to_engine_hash(seq.block_hashes[1]),), medium=Medium.MOONCAKE)


def run_of(num_blocks: int) -> tuple[list[bytes], list[tuple[int, ...]], list[bytes]]:
    tokens = [500 + i for i in range(num_blocks * BS)]
    payloads: list[bytes] = []
    hashes = extend_block_hashes([], namespace_root(), tokens, BS, payloads)
    return hashes, [tuple(tokens[i * BS : (i + 1) * BS]) for i in range(num_blocks)], payloads


@pytest.mark.parametrize("with_payloads", [False, True])
def test_a_run_is_built_byte_for_byte_as_its_chunks_one_by_one(with_payloads: bool):
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    hashes, tokens, payloads = run_of(5)
    assert payloads[2] == b"".join(t.to_bytes(4, "little") for t in tokens[2])  # the tokens as hashed
    run, one_by_one = HostBuffer(6 * VALUE_BYTES), HostBuffer(6 * VALUE_BYTES)
    layout.write_run(run, 100, hashes, tokens, payloads if with_payloads else None)
    for j in range(5):
        layout.write(one_by_one.view, 100 + j * VALUE_BYTES, hashes[j], tokens[j])
    assert run.data == one_by_one.data
    with pytest.raises(ValueError, match="one full block"):
        layout.write_run(run, 0, hashes[:2], tokens[:1])


@pytest.mark.parametrize("position", [0, 5, 20, 50, 80, 95, 200, 316, 552, 800, 1000, 1023])
@pytest.mark.parametrize("with_payloads", [False, True])
def test_a_run_check_stops_at_the_chunk_with_one_altered_byte(position: int, with_payloads: bool):
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    hashes, tokens, payloads = run_of(6)
    data = HostBuffer(6 * VALUE_BYTES)
    layout.write_run(data, 0, hashes, tokens)
    given = payloads if with_payloads else None
    assert layout.check_run(data.data, 0, hashes, tokens, True, given) == 6
    data.data[4 * VALUE_BYTES + position] ^= 0x01  # chunk 4
    is_padding = any(80 + g * 236 + 16 <= position < 80 + (g + 1) * 236 for g in range(GROUPS)) or position >= 1024
    assert layout.check_run(data.data, 0, hashes, tokens, True, given) == 4
    assert layout.check_run(data.data, 0, hashes, tokens, False, given) == (6 if is_padding else 4)
    assert layout.check_run(data.data, VALUE_BYTES, hashes[1:], tokens[1:], True,
                            given and given[1:]) == 3  # fmt: skip
    assert layout.check_run(data.data, 0, hashes[:4], tokens[:4], True, given and given[:4]) == 4


def test_a_run_from_payloads_alone_is_the_run_from_tokens_and_its_check_refuses_a_changed_digest():
    layout = ChunkLayout(BS, GROUPS, VALUE_BYTES)
    hashes, tokens, payloads = run_of(6)
    from_tokens, from_payloads = HostBuffer(6 * VALUE_BYTES), HostBuffer(6 * VALUE_BYTES)
    layout.write_run(from_tokens, 0, hashes, tokens)
    layout.write_run(from_payloads, 0, hashes, (), payloads)  # no token lists: the digests from the payloads
    assert from_payloads.data == from_tokens.data
    assert layout.check_run(from_tokens.data, 0, hashes, (), True, payloads) == 6
    for group in (0, GROUPS - 1):
        for byte in (0, 7):  # a digest's least and most significant byte (little-endian)
            at = 3 * VALUE_BYTES + HEAD_BYTES + 8 * group + byte
            from_tokens.data[at] ^= 0x80
            assert layout.check_run(from_tokens.data, 0, hashes, (), True, payloads) == 3
            assert layout.check_run(from_tokens.data, 0, hashes, (), False, payloads) == 3
            from_tokens.data[at] ^= 0x80
    other_hashes, _, other_payloads = run_of(7)  # another chain: its chunks are foreign to this one
    assert layout.check_run(from_tokens.data, 0, other_hashes[1:], (), True, other_payloads[1:]) == 0
    with pytest.raises(ValueError, match="one full block"):
        layout.write_run(from_payloads, 0, hashes, (), payloads[:5])


@pytest.mark.parametrize(
    ("value_bytes", "num_check_threads"),
    [(VALUE_BYTES, 1), (3 << 17, 1), (3 << 17, 3), ((5 << 20) + 13, 3)],
)  # padding: numpy columns / long ranges as words, on one thread or three, in slices (5 MiB: 2 MiB ones, unaligned)
@pytest.mark.parametrize(
    "where", ["manifest magic", "manifest hash", "manifest digest", "payload", "padding", "last padding", "tail"]
)
def test_a_single_flipped_byte_in_a_manifest_payload_or_padding_is_detected(
    value_bytes: int, num_check_threads: int, where: str
):
    layout = ChunkLayout(BS, GROUPS, value_bytes, num_check_threads)
    hashes, tokens, payloads = run_of(6)
    data = HostBuffer(6 * value_bytes)
    layout.write_run(data, 0, hashes, tokens)
    head, piece, n = layout.header_bytes, layout.piece_bytes, layout.payload_bytes
    assert layout.check_run(data.data, 0, hashes, (), True, payloads) == 6
    at = {
        "manifest magic": 2,
        "manifest hash": 16 + 31,
        "manifest digest": HEAD_BYTES + 8 * (GROUPS - 1) + 3,
        "payload": head + (GROUPS - 1) * piece + n - 1,  # the last layer group's last token byte
        "padding": head + piece + n,  # the second layer group's first padding byte
        "last padding": head + GROUPS * piece - 1,
        "tail": value_bytes - 1,  # the chunk's last byte (in the tail where there is one)
    }[where]
    is_padding = where in ("padding", "last padding", "tail")
    data.data[3 * value_bytes + at] ^= 0x01  # chunk 3
    assert layout.check_run(data.data, 0, hashes, (), True, payloads) == 3
    assert layout.check_run(data.data, 0, hashes, tokens, True) == 3
    assert layout.check_run(data.data, 0, hashes, (), False, payloads) == (6 if is_padding else 3)
    assert layout.check_run(data.data, 4 * value_bytes, hashes[4:], (), True, payloads[4:]) == 2  # after it
    data.data[3 * value_bytes + at] ^= 0x01
    assert layout.check_run(data.data, 0, hashes, (), True, payloads) == 6
    layout.close()


@pytest.mark.parametrize("num_check_threads", [1, 2, 5])
def test_a_flipped_byte_at_every_slice_edge_of_a_long_padding_range_is_detected(num_check_threads: int):
    value_bytes = (5 << 20) + 5  # one piece: its padding runs 5 MiB, 3 slices, none 8-byte aligned at its ends
    layout = ChunkLayout(BS, 1, value_bytes, num_check_threads)
    hashes, tokens, payloads = run_of(3)
    data = HostBuffer(4 * value_bytes)
    layout.write_run(data, 3, hashes, tokens)  # at offset 3: the rows' ranges start off the word grid
    assert layout.check_run(data.data, 3, hashes, (), True, payloads) == 3
    pad_at = layout.header_bytes + layout.payload_bytes  # 72: the padding's first byte
    slice_bytes = pool_zero.SLICE_BYTES
    for chunk in range(3):
        base = 3 + chunk * value_bytes
        word_start = pad_at + (-(data.address + base + pad_at) % 8)  # the first whole word of the range
        for at in (pad_at, word_start - 1, word_start, word_start + slice_bytes - 1, word_start + slice_bytes,
                   word_start + 2 * slice_bytes, value_bytes - 8, value_bytes - 1):  # fmt: skip
            data.data[base + at] ^= 0x80
            assert layout.check_run(data.data, 3, hashes, (), True, payloads) == chunk, (chunk, at)
            data.data[base + at] ^= 0x80
    assert layout.check_run(data.data, 3, hashes, (), True, payloads) == 3
    layout.close()  # a check after it runs on the calling thread alone, every byte still
    data.data[3 + 2 * value_bytes + value_bytes // 2] ^= 0x01
    assert layout.check_run(data.data, 3, hashes, (), True, payloads) == 2


def test_check_threads_are_half_the_cores_bounded():
    assert [pool_zero.default_check_threads(c) for c in (1, 2, 3, 4, 16, 64)] == [1, 1, 1, 2, 8, 8]
    assert 1 <= pool_zero.default_check_threads() <= pool_zero.MAX_CHECK_THREADS
    with pytest.raises(ValueError, match="num_threads must be positive, not 0"):
        ChunkLayout(BS, 1, 0, 0)
