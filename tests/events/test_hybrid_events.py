"""Hybrid-model KV events: per-group stores and removals as vLLM publishes them (fixtures in
tests/fixtures/events/payloads.py), decoded and encoded exactly."""

from __future__ import annotations

import msgspec
import pytest

from events.counters import DropKind, EventCounters
from events.decode import EventDecoder
from events.encode import encode_batch
from events.types import BlockRemoved, BlockStored, EngineBlockHash, Medium, SpecKind, is_sparse_group
from tests.fixtures.events import payloads as p

pytestmark = pytest.mark.unit


def hy(*indices: int) -> tuple[EngineBlockHash, ...]:
    return tuple(EngineBlockHash(p.HY[i]) for i in indices)


def decode(payload: bytes) -> tuple[tuple[object, ...], EventCounters]:
    counters = EventCounters()
    batch = EventDecoder(counters).decode(payload, worker_id="w0", seq=0, block_size=4)
    assert batch is not None
    return batch.events, counters


def test_mamba_hybrid_prefill_one_store_per_group_with_the_same_digests():
    events, counters = decode(p.HYBRID_MAMBA)
    assert events == (
        BlockStored(
            block_hashes=hy(0, 1, 2),
            parent_block_hash=None,
            token_ids=tuple(range(12)),
            block_size=4,
            extra_keys=(None, None, None),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=hy(2),
            parent_block_hash=None,
            token_ids=tuple(range(12)),
            block_size=4,
            extra_keys=(None,),
            group_idx=1,
            kv_cache_spec_kind="mamba",
        ),
    )
    assert [e.num_skipped_blocks for e in events if isinstance(e, BlockStored)] == [0, 2]
    assert counters.total_drops() == 0


def test_mamba_state_eviction_names_its_group():
    events, counters = decode(p.HYBRID_MAMBA_EVICT)
    assert events == (BlockRemoved(block_hashes=hy(2), medium=Medium.GPU, group_idx=1),)
    assert counters.total_drops() == 0


def test_sliding_window_chunk_skips_the_block_that_left_the_window():
    events, counters = decode(p.HYBRID_SWA_CHUNK)
    assert events == (
        BlockStored(
            block_hashes=hy(3, 4),
            parent_block_hash=EngineBlockHash(p.HY[2]),
            token_ids=tuple(range(12, 20)),
            block_size=4,
            extra_keys=(None, None),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=hy(4),
            parent_block_hash=EngineBlockHash(p.HY[2]),
            token_ids=tuple(range(12, 20)),
            block_size=4,
            extra_keys=(None,),
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            sliding_window_tokens=8,
        ),
    )
    assert events[1].num_skipped_blocks == 1  # type: ignore[union-attr]
    assert counters.total_drops() == 0


def test_the_legacy_array_shape_of_a_sparse_store_decodes_too():
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [p.HY[2]], None, list(range(12)), 4, None, "GPU", None, None, 1, "mamba", None]], 0]
    )
    events, counters = decode(payload)
    assert events == (
        BlockStored(hy(2), None, tuple(range(12)), 4, Medium.GPU, None, None, 1, "mamba", None),
    )
    assert counters.total_drops() == 0


SPARSE_REFUSED = [
    # a full-attention group keeps every block: more tokens than hashes is a broken store
    ("full_attention_extra_tokens", {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}, list(range(12))),
    # group 0 without a kind is the main full-attention group of an older vLLM
    ("group0_without_kind", {"group_idx": 0}, list(range(12))),
    # tokens must still be whole blocks
    ("sparse_partial_block", {"group_idx": 1, "kv_cache_spec_kind": "mamba"}, list(range(10))),
    # and never fewer than the hashes name
    ("sparse_too_few_tokens", {"group_idx": 1, "kv_cache_spec_kind": "mamba"}, list(range(4))),
]


@pytest.mark.parametrize(("name", "fields", "tokens"), SPARSE_REFUSED, ids=[c[0] for c in SPARSE_REFUSED])
def test_token_counts_no_vllm_group_sends_are_refused(name, fields, tokens):
    event = {
        "type": "BlockStored",
        "block_hashes": [p.HY[1], p.HY[2]],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **fields,
    }
    events, counters = decode(msgspec.msgpack.encode([1.0, [event], 0]))
    assert events == ()
    assert counters.drops == {("w0", DropKind.TOKEN_COUNT_MISMATCH): 1}


def test_sparse_rule_per_kind():
    assert [is_sparse_group(k.value, 0) for k in SpecKind] == [
        False,  # full_attention
        False,  # mla_attention
        True,  # sliding_window
        True,  # sliding_window_mla
        True,  # mamba
        True,  # chunked_local_attention
        False,  # sink_full_attention
        True,  # encoder_only_attention
        True,  # cross_attention
        True,  # unknown
    ]
    assert (is_sparse_group(None, 0), is_sparse_group(None, 2)) == (False, True)


def test_encoder_round_trips_a_sparse_mamba_store_and_its_removal():
    events = [
        BlockStored(hy(2), None, tuple(range(12)), 4, Medium.GPU, None, None, 1, "mamba", None),
        BlockRemoved(block_hashes=hy(2), medium=Medium.GPU, group_idx=1),
    ]
    for shape in ("vllm", "vllm-legacy"):
        payload = encode_batch(events, 2.0, 0, shape)  # type: ignore[arg-type]
        decoded, counters = decode(payload)
        assert decoded == tuple(events)
        assert counters.total_drops() == 0
    raw = msgspec.msgpack.decode(encode_batch(events, 2.0, 0))
    assert raw[1][0]["group_idx"] == 1 and raw[1][0]["kv_cache_spec_kind"] == "mamba"
    assert "kv_cache_spec_sliding_window" not in raw[1][0]
