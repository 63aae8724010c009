"""Decoder tests against hand-built payloads (tests/fixtures/events/payloads.py) and every bad input."""

from __future__ import annotations

import msgspec
import pytest

from events.counters import DropKind, EventCounters
from events.decode import EventDecoder
from events.encode import encode_batch
from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, Medium
from tests.fixtures.events import payloads as p

pytestmark = pytest.mark.unit

U64 = (1 << 64) - 1


def h(value: int) -> EngineBlockHash:
    return EngineBlockHash(value & U64)


def make_decoder() -> tuple[EventDecoder, EventCounters]:
    counters = EventCounters()
    return EventDecoder(counters), counters


def test_vllm_map_shape_live_capture():
    dec, counters = make_decoder()
    batch = dec.decode(p.VLLM_MAP, worker_id="w0", seq=22, block_size=4)
    assert batch is not None
    assert (batch.worker_id, batch.seq, batch.dp_rank, batch.ts_s) == ("w0", 22, 1, 1796028555.25)
    assert batch.events == (
        BlockRemoved(block_hashes=(h(8525451257729239962),), medium=Medium.GPU, group_idx=0),
        BlockStored(
            block_hashes=(h(p.H1), h(p.H2)),
            parent_block_hash=None,
            token_ids=(0, 1, 2, 3, 4, 5, 6, 7),
            block_size=4,
            medium=Medium.GPU,
            extra_keys=(None, None),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
    )
    assert counters.total_drops() == 0


def test_vllm_legacy_arrays():
    dec, counters = make_decoder()
    batch = dec.decode(p.VLLM_LEGACY, worker_id="w0", seq=1, block_size=4, default_dp_rank=3)
    assert batch is not None
    assert batch.dp_rank == 3  # nil on the wire: the configured rank
    assert batch.events == (
        BlockStored(
            block_hashes=(h(p.H2),),
            parent_block_hash=h(p.H1),
            token_ids=(8, 9, 10, 11),
            block_size=4,
            lora_name="adapter-a",
            group_idx=0,
        ),
        BlockRemoved(block_hashes=(h(p.H1),)),
        AllBlocksCleared(),
    )
    assert counters.total_drops() == 0


def test_oldest_vllm_without_dp_rank():
    dec, counters = make_decoder()
    batch = dec.decode(p.VLLM_OLDEST_NO_DP, worker_id="w0", seq=0, block_size=4)
    assert batch is not None
    assert batch.dp_rank == 0 and batch.ts_s == 3.0
    assert batch.events == (
        BlockStored(block_hashes=(h(7),), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4),
        BlockRemoved(block_hashes=(h(7),)),
    )
    assert counters.total_drops() == 0


def test_sglang_pages_signed_hashes():
    dec, counters = make_decoder()
    batch = dec.decode(p.SGLANG_PAGES, worker_id="sgl", seq=0, block_size=4)
    assert batch is not None
    assert batch.dp_rank == 1
    assert [e.block_hashes for e in batch.events] == [(p.SGL_H0,), (p.SGL_H1,), (p.SGL_NEG + (1 << 64),)]
    assert [e.parent_block_hash for e in batch.events] == [None, p.SGL_H0, p.SGL_H1]  # type: ignore[union-attr]
    assert batch.events[2].token_ids == (8, 9, 10, 11)  # type: ignore[union-attr]
    assert batch.events[2].block_hashes == (0xEEDDCCBBAA998878,)
    assert counters.total_drops() == 0


def test_cpu_offload_store_without_tokens_or_parent():
    dec, counters = make_decoder()
    batch = dec.decode(p.CPU_OFFLOAD, worker_id="w0", seq=0, block_size=4)
    assert batch is not None
    assert batch.events == (
        BlockStored(block_hashes=(h(p.H2),), parent_block_hash=None, token_ids=(), block_size=8, medium=Medium.CPU),
    )
    assert counters.total_drops() == 0


def test_all_blocks_cleared_scoped_and_unscoped():
    dec, _ = make_decoder()
    batch = dec.decode(p.CLEARED, worker_id="w0", seq=0)
    assert batch is not None
    assert batch.events == (AllBlocksCleared(medium=None), AllBlocksCleared(medium=Medium.CPU))
    assert batch.dp_rank == 0


def test_map_shaped_outer_batch():
    dec, counters = make_decoder()
    batch = dec.decode(p.MAP_BATCH, worker_id="w0", seq=4)
    assert batch is not None
    assert (batch.dp_rank, batch.ts_s) == (2, 7.0)
    assert batch.events == (BlockRemoved(block_hashes=(h(p.H1),), medium=Medium.MOONCAKE, group_idx=1),)
    assert counters.total_drops() == 0


def test_bytes_hashes_folded_like_vllm_int_form():
    dec, _ = make_decoder()
    batch = dec.decode(p.BYTES_HASHES, worker_id="w0", seq=0, block_size=4)
    assert batch is not None
    assert batch.events[0].block_hashes == (p.H1,)  # type: ignore[union-attr]


def test_bigram_token_ids():
    dec, _ = make_decoder()
    batch = dec.decode(p.BIGRAM, worker_id="w0", seq=0, block_size=4)
    assert batch is not None
    assert batch.events[0].token_ids == (20, 21, 22, 23)  # type: ignore[union-attr]


def test_seq_and_end_marker_bytes():
    from events.publisher import SEQ_END_MARKER

    assert (5).to_bytes(8, "big") == p.SEQ_5
    assert SEQ_END_MARKER == p.END_SEQ


def test_encoder_matches_hand_written_legacy_bytes():
    events = [
        BlockStored(
            block_hashes=(h(p.H2),),
            parent_block_hash=h(p.H1),
            token_ids=(8, 9, 10, 11),
            block_size=4,
            lora_name="adapter-a",
        ),
        BlockRemoved(block_hashes=(h(p.H1),)),
        AllBlocksCleared(),
    ]
    assert encode_batch(events, 2.5, None, "vllm-legacy") == p.VLLM_LEGACY


def test_encoder_map_shape_round_trip_keeps_hybrid_fields():
    events = [
        BlockStored(
            block_hashes=(h(1), h(2)),
            parent_block_hash=h(9),
            token_ids=tuple(range(8)),
            block_size=4,
            extra_keys=(("salt",), None),
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            sliding_window_tokens=128,
        ),
        BlockRemoved(block_hashes=(h(U64),), medium=Medium.CPU, group_idx=1),
        AllBlocksCleared(medium=Medium.CPU),
    ]
    payload = encode_batch(events, 1.0, 0)
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["kv_cache_spec_sliding_window"] == 128
    dec, counters = make_decoder()
    batch = dec.decode(payload, worker_id="w", seq=0, block_size=4)
    assert batch is not None and batch.events == tuple(events)
    assert counters.total_drops() == 0


# --- bad input: each counted by kind, nothing emitted ----------------------------------------------------------


def stored_map(**fields):
    base = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    base.update(fields)
    return base


BAD_EVENTS = [
    ("token_count", stored_map(token_ids=list(range(7))), DropKind.TOKEN_COUNT_MISMATCH),
    ("block_size", stored_map(block_size=8, token_ids=list(range(16))), DropKind.BLOCK_SIZE_MISMATCH),
    ("repeated", stored_map(block_hashes=[1, 1]), DropKind.REPEATED_HASH),
    ("parent_repeated", stored_map(parent_block_hash=2), DropKind.REPEATED_HASH),
    ("unknown_tag", {"type": "BlockMoved", "block_hashes": [1]}, DropKind.UNKNOWN_EVENT),
    ("unknown_medium", stored_map(medium="NVME_OF"), DropKind.UNKNOWN_MEDIUM),
    ("remote", stored_map(locality="REMOTE"), DropKind.REMOTE_LOCALITY),
    ("bad_hash_type", stored_map(block_hashes=["x", 2]), DropKind.MALFORMED_EVENT),
    ("missing_field", {"type": "BlockStored", "block_hashes": [1]}, DropKind.MALFORMED_EVENT),
    ("no_hashes", stored_map(block_hashes=[], token_ids=[]), DropKind.MALFORMED_EVENT),
    ("offload_bad_multiple", stored_map(medium="CPU", block_size=6, token_ids=[]), DropKind.BLOCK_SIZE_MISMATCH),
    ("not_an_event", 17, DropKind.MALFORMED_EVENT),
    ("array_too_short", ["BlockStored", [1], None], DropKind.MALFORMED_EVENT),
    ("token_negative", stored_map(token_ids=[0, 1, 2, -1, 4, 5, 6, 7]), DropKind.MALFORMED_EVENT),
    ("token_2_32", stored_map(token_ids=[0, 1, 2, 2**32, 4, 5, 6, 7]), DropKind.MALFORMED_EVENT),
    ("token_u64_max", stored_map(token_ids=[U64, 1, 2, 3, 4, 5, 6, 7]), DropKind.MALFORMED_EVENT),
    ("token_bigram_2_32", stored_map(token_ids=[[2**32, 1]] + [[i, i + 1] for i in range(7)]),
     DropKind.MALFORMED_EVENT),
    ("token_array_negative", ["BlockStored", [1], None, [0, -5, 2, 3], 4, None, "GPU"], DropKind.MALFORMED_EVENT),
    ("group_negative", stored_map(group_idx=-1), DropKind.MALFORMED_EVENT),
    ("group_array_negative", ["BlockStored", [1], None, [0, 1, 2, 3], 4, None, "GPU", None, None, -1],
     DropKind.MALFORMED_EVENT),
    ("removed_group_negative", {"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1},
     DropKind.MALFORMED_EVENT),
]


@pytest.mark.parametrize(("name", "event", "kind"), BAD_EVENTS, ids=[b[0] for b in BAD_EVENTS])
def test_bad_event_counted_and_not_emitted(name, event, kind):
    dec, counters = make_decoder()
    payload = msgspec.msgpack.encode([1.0, [event], 0])
    batch = dec.decode(payload, worker_id="w9", seq=3, block_size=4)
    assert batch is not None and batch.events == ()
    assert counters.drops == {("w9", kind): 1}


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x93\xcb", b"\xc1\xc1", msgspec.msgpack.encode("text"), msgspec.msgpack.encode([1.0]),
     msgspec.msgpack.encode(["ts", []]), msgspec.msgpack.encode([1.0, [], "rank"]),
     msgspec.msgpack.encode({"events": []})],
    ids=["empty", "truncated", "garbage", "string", "short", "ts_type", "rank_type", "map_no_ts"],
)
def test_malformed_payload_dropped(payload):
    dec, counters = make_decoder()
    assert dec.decode(payload, worker_id="w1", seq=0) is None
    assert counters.drops == {("w1", DropKind.MALFORMED_PAYLOAD): 1}


def test_unknown_field_skipped_event_kept():
    dec, counters = make_decoder()
    payload = msgspec.msgpack.encode([1.0, [stored_map(shiny_new_field=[1, 2])], 0])
    batch = dec.decode(payload, worker_id="w1", seq=0, block_size=4)
    assert batch is not None and batch.events[0].block_hashes == (1, 2)  # type: ignore[union-attr]
    assert counters.drops == {("w1", DropKind.UNKNOWN_FIELD): 1}


def test_removed_with_repeated_hashes_kept_once_each():
    dec, counters = make_decoder()
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [5, 6, 5], "medium": "GPU"}]])
    batch = dec.decode(payload, worker_id="w1", seq=0)
    assert batch is not None and batch.events == (BlockRemoved(block_hashes=(h(5), h(6))),)
    assert counters.drops == {("w1", DropKind.REPEATED_HASH): 1}


def test_good_events_survive_next_to_bad_ones():
    dec, counters = make_decoder()
    payload = msgspec.msgpack.encode([1.0, [stored_map(token_ids=[1]), stored_map(block_hashes=[7, 8])], 0])
    batch = dec.decode(payload, worker_id="w1", seq=0, block_size=4)
    assert batch is not None
    assert [e.block_hashes for e in batch.events] == [(7, 8)]  # type: ignore[union-attr]
    assert counters.drops == {("w1", DropKind.TOKEN_COUNT_MISMATCH): 1}


def test_drop_logged_once_per_worker_and_kind(caplog):
    dec, counters = make_decoder()
    payload = msgspec.msgpack.encode([1.0, [stored_map(token_ids=[1])], 0])
    with caplog.at_level("WARNING", logger="events.counters"):
        for _ in range(3):
            dec.decode(payload, worker_id="w1", seq=0, block_size=4)
        dec.decode(payload, worker_id="w2", seq=0, block_size=4)
    assert counters.drops == {("w1", DropKind.TOKEN_COUNT_MISMATCH): 3, ("w2", DropKind.TOKEN_COUNT_MISMATCH): 1}
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2


def test_token_id_range_edges_and_neighbours_kept():
    dec, counters = make_decoder()
    top = 2**32 - 1
    good = stored_map(block_hashes=[7, 8], token_ids=[0, 1, 2, 3, 4, 5, 6, top])
    bad = stored_map(block_hashes=[9], token_ids=[0, 1, 2, 2**32])
    removed = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 2**40}
    batch = dec.decode(msgspec.msgpack.encode([1.0, [good, bad, removed], 0]), worker_id="w1", seq=0, block_size=4)
    assert batch is not None
    assert batch.events == (
        BlockStored(block_hashes=(h(7), h(8)), parent_block_hash=None, token_ids=(0, 1, 2, 3, 4, 5, 6, top),
                    block_size=4),
        BlockRemoved(block_hashes=(h(3),), group_idx=2**40),  # which groups exist is the index's to check
    )
    assert counters.drops == {("w1", DropKind.MALFORMED_EVENT): 1}
