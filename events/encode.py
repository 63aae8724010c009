"""Encode normalized KV events into vLLM's wire shapes (used by our reference worker's publisher).

Two shapes, both msgpack (source: vLLM ``vllm/distributed/kv_events.py``; the "current" shape is what a live
vLLM 0.26+ stream carries, see ``shared/reference/kv-events-and-routers.md`` §1.4-1.5)::

    "vllm" (default, vLLM >= 0.24):
        [ts, [ {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h|nil, "token_ids": [...],
                "block_size": n, "lora_id": nil, "medium": "GPU", "lora_name": s|nil,
                ["extra_keys": [...]], "group_idx": g, ["kv_cache_spec_kind": s],
                ["kv_cache_spec_sliding_window": n]},
               {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": g},
               {"type": "AllBlocksCleared", ["medium": "CPU"]} ],
         dp_rank]
        Optional keys (in brackets) are omitted when unset, as msgspec's ``omit_defaults`` does.

    "vllm-legacy" (vLLM <= 0.23, every field positional, defaults written as nil):
        [ts, [ ["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
                extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window],
               ["BlockRemoved", block_hashes, medium, group_idx],
               ["AllBlocksCleared"] ],
         dp_rank]

Block hashes go out as msgpack unsigned ints (``EngineBlockHash`` is already a u64). ``group_idx`` is always
written (a live vLLM stream carries ``group_idx: 0``). A ``medium`` on AllBlocksCleared is written only when set.

Public API:
    WireShape                                   Literal["vllm", "vllm-legacy"]
    BatchEncoder(wire_shape="vllm")             .encode(events, ts_s, dp_rank) -> bytes
    encode_batch(events, ts_s, dp_rank, wire_shape="vllm") -> bytes   (one-off convenience)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from events.errors import EventsConfigError
from events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

WireShape = Literal["vllm", "vllm-legacy"]
"""Which of vLLM's wire shapes to publish."""


# --- current vLLM shape: tagged maps inside a positional batch -------------------------------------------------


class _MapBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: Sequence[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: Sequence[int]
    medium: str | None
    group_idx: int | None = None


class _MapAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True, gc=False):
    medium: str | None = None


# --- legacy vLLM shape: tagged arrays (tag first), defaults written as nil ----------------------------------


class _ArrayBlockStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: Sequence[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: Sequence[int]
    medium: str | None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: Sequence[Any]
    data_parallel_rank: int | None


def _converter(
    stored: type[_MapBlockStored] | type[_ArrayBlockStored],
    removed: type[_MapBlockRemoved] | type[_ArrayBlockRemoved],
    cleared: Callable[[AllBlocksCleared], msgspec.Struct],
) -> Callable[[KVEvent], msgspec.Struct]:
    """A converter from normalized events to one wire shape's structs (``cleared`` builds the shape's
    ``AllBlocksCleared``, which differs between the shapes)."""

    def convert(event: KVEvent) -> msgspec.Struct:
        if isinstance(event, BlockStored):
            return stored(
                block_hashes=event.block_hashes,
                parent_block_hash=event.parent_block_hash,
                token_ids=event.token_ids,
                block_size=event.block_size,
                lora_id=None,
                medium=event.medium.value,
                lora_name=event.lora_name,
                extra_keys=event.extra_keys,
                group_idx=event.group_idx,
                kv_cache_spec_kind=event.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=event.sliding_window_tokens,
            )
        if isinstance(event, BlockRemoved):
            return removed(block_hashes=event.block_hashes, medium=event.medium.value, group_idx=event.group_idx)
        if isinstance(event, AllBlocksCleared):
            return cleared(event)
        raise TypeError(f"not a KV event: {type(event).__name__}")

    return convert


_to_map = _converter(
    _MapBlockStored,
    _MapBlockRemoved,
    lambda event: _MapAllBlocksCleared(medium=None if event.medium is None else event.medium.value),
)
_to_array = _converter(_ArrayBlockStored, _ArrayBlockRemoved, lambda event: _ArrayAllBlocksCleared())


class BatchEncoder:
    """Encodes batches of normalized events into one of vLLM's wire shapes.

    Not thread-safe (it reuses one ``msgspec.msgpack.Encoder`` buffer); give each thread its own.

    Args:
        wire_shape: ``"vllm"`` (array batch, tagged-map events) or ``"vllm-legacy"`` (all arrays).

    Raises:
        EventsConfigError: for an unknown ``wire_shape``.
    """

    def __init__(self, wire_shape: WireShape = "vllm") -> None:
        if wire_shape == "vllm":
            self._convert = _to_map
        elif wire_shape == "vllm-legacy":
            self._convert = _to_array
        else:
            raise EventsConfigError(f"unknown wire shape {wire_shape!r}; expected 'vllm' or 'vllm-legacy'")
        self.wire_shape: WireShape = wire_shape
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: Sequence[KVEvent], ts_s: float, dp_rank: int | None) -> bytes:
        """Encode one batch.

        Args:
            events: normalized events in publish order.
            ts_s: wall-clock time of the batch in seconds (written as a msgpack float).
            dp_rank: data-parallel rank written as the batch's third element, or ``None`` (written as nil).

        Returns:
            The msgpack payload (the third frame of a published message).

        Raises:
            TypeError: if an element of ``events`` is not a normalized KV event.
        """
        convert = self._convert
        batch = _WireBatch(ts=float(ts_s), events=[convert(e) for e in events], data_parallel_rank=dp_rank)
        return self._encoder.encode(batch)


def encode_batch(
    events: Sequence[KVEvent], ts_s: float, dp_rank: int | None, wire_shape: WireShape = "vllm"
) -> bytes:
    """Encode one batch with a fresh encoder. See ``BatchEncoder.encode`` for the arguments and errors."""
    return BatchEncoder(wire_shape).encode(events, ts_s, dp_rank)
