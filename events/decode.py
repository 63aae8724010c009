"""Decode KV event batches in every shape vLLM and SGLang put on the wire into ``events.types`` structs.

Frames: ``[topic, seq (8 B big-endian), payload]`` (see ``events.publisher``). This module decodes the payload.

Outer batch (any of)::

    [ts, events]                           vLLM <= 0.9
    [ts, events, dp_rank | nil]            vLLM (``data_parallel_rank``), SGLang (``attn_dp_rank``)
    {"ts": .., "events": [..], "data_parallel_rank" | "attn_dp_rank" | "dp_rank": ..}   map-shaped batch

Inner events (any mix of)::

    tagged arrays  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                    lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality]
                   ["BlockRemoved", block_hashes, medium, group_idx, locality]
                   ["AllBlocksCleared", medium]
                   (any length from the required prefix: 4 fields for BlockStored, 1 for BlockRemoved, 0 for
                   AllBlocksCleared; SGLang's BlockStoredWithMetadata puts a map in the lora_name slot: skipped)
    tagged maps    {"type": "BlockStored", "block_hashes": .., ...}   any key order, absent keys = defaults

Values: hashes as msgpack u64, negative i64 (reinterpreted as u64) or bytes (last 8 bytes big-endian, as vLLM's
int form); ``token_ids`` flat or as bigram pairs ``[[t0, t1], [t1, t2], ...]`` (EAGLE; first elements kept);
``medium`` strings of both engines normalized by ``events.types.normalize_medium`` (nil = GPU, except on
AllBlocksCleared where nil means all of the worker's own tiers).

Validation (each refusal counted by ``events.counters.DropKind`` and logged once per worker and kind; nothing
invalid is returned):
    * garbage/truncated msgpack or a wrong outer shape drops the batch (``decode`` returns ``None``);
    * an unknown event tag skips the event; an unknown field is skipped and counted, its event kept;
    * a GPU-tier BlockStored must carry ``block_size * len(block_hashes)`` tokens and, when the worker's block
      size is configured, exactly that block size (refused otherwise, as Dynamo does); a store of a sparse group
      (sliding window, Mamba: ``events.types.is_sparse_group``) may carry a larger multiple of ``block_size``:
      vLLM skips the null blocks of the range when it lists hashes, never when it lists tokens (a sparse store
      naming no block at all, which vLLM 0.32 sends for a sliding window's generated blocks, is skipped uncounted);
    * an offload-tier BlockStored (CPU, DISK, MOONCAKE) may have no tokens, no parent and ``block_size`` 0 or a
      multiple of the GPU block size; tokens, when present, must still match;
    * a BlockStored with a repeated hash (or one equal to its parent) is refused; a BlockRemoved with repeated
      hashes is counted and kept with each hash once;
    * a token id outside ``[0, 2**32)`` (our block hash packs tokens as uint32) or a negative ``group_idx``
      refuses the event (``MALFORMED_EVENT``); which groups a model has is the index's to check;
    * ``locality`` other than ``LOCAL`` drops the event.

Speed: the common shapes (array batch with tagged-map events, or all arrays, int hashes, flat tokens) go through
typed ``msgspec`` decoders created once; anything else falls back to an untyped decode and per-field dispatch.
The decoder remembers, per worker, which typed decoder worked last.

Public API:
    EventDecoder(counters)
        .decode(payload, *, worker_id, seq, block_size=None, default_dp_rank=0) -> EventBatch | None
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec

from events.counters import DropKind, EventCounters
from events.types import (
    MAX_TOKEN_ID,
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
    KVEvent,
    Medium,
    is_sparse_group,
    normalize_medium,
)

logger = logging.getLogger(__name__)

# --- typed fast path --------------------------------------------------------------------------------------------

# Range checks inside the typed decoders cost nothing on valid input; a violation makes the typed decode fail, and
# the untyped fallback then refuses just the offending event (counted ``MALFORMED_EVENT``).
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
GroupIdx = Annotated[int, msgspec.Meta(ge=0)]


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True, gc=False):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[TokenId, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: Any = None
    session_id: Any = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", forbid_unknown_fields=True, gc=False):
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: GroupIdx | None = None
    locality: str | None = None
    ownership: Any = None
    session_id: Any = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True, gc=False):
    medium: str | None = None


class _MapBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, forbid_unknown_fields=True, gc=False):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[TokenId, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, forbid_unknown_fields=True, gc=False):
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: GroupIdx | None = None
    locality: str | None = None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, forbid_unknown_fields=True, gc=False):
    medium: str | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_FAST_STORED = (_MapStored, _ArrayStored)
_FAST_REMOVED = (_MapRemoved, _ArrayRemoved)

# --- untyped fallback: positional schemas and known map keys ----------------------------------------------------

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
_CLEARED_FIELDS = ("medium",)
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
_POSITIONAL = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": _CLEARED_FIELDS}
# Keys a real engine sends that we read nothing from: accepted without counting them as unknown.
_IGNORED_KEYS = frozenset({"type", "lora_id", "ownership", "session_id", "metadata"})
_BATCH_DP_KEYS = ("data_parallel_rank", "attn_dp_rank", "dp_rank")


class _NothingStored(Exception):
    """A valid store that names no block: skipped without counting (internal control flow)."""


class _Refused(Exception):
    """One event refused; carries the drop kind (internal control flow, never escapes this module)."""

    def __init__(self, kind: DropKind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    return value


def _freeze_extra_keys(extra_keys: Any) -> tuple[object, ...] | None:
    if extra_keys is None:
        return None
    if not isinstance(extra_keys, list | tuple):
        raise _Refused(DropKind.MALFORMED_EVENT, f"extra_keys is {type(extra_keys).__name__}, not a list")
    if not any(extra_keys):
        return tuple(extra_keys)
    return tuple(_freeze(k) for k in extra_keys)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _raw_hash(value: Any) -> EngineBlockHash:
    if _is_int(value):
        return EngineBlockHash(value & U64_MASK)
    if isinstance(value, bytes) and value:
        return EngineBlockHash(int.from_bytes(value[-8:], "big"))
    raise _Refused(DropKind.MALFORMED_EVENT, f"block hash of type {type(value).__name__}")


def _raw_hashes(value: Any) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list):
        raise _Refused(DropKind.MALFORMED_EVENT, "block_hashes is not a list")
    return tuple(_raw_hash(v) for v in value)


def _raw_tokens(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _Refused(DropKind.MALFORMED_EVENT, "token_ids is not a list")
    if value and isinstance(value[0], list):
        # EAGLE bigram pairs [[t0, t1], [t1, t2], ...]: one pair per token position, first element is the token.
        if not all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_int(p[1]) for p in value):
            raise _Refused(DropKind.MALFORMED_EVENT, "token_ids mixes bigram pairs and other values")
        tokens = tuple(p[0] for p in value)
    elif not all(_is_int(t) for t in value):
        raise _Refused(DropKind.MALFORMED_EVENT, "token_ids holds a non-integer")
    else:
        tokens = tuple(value)
    if tokens and (min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID):
        raise _Refused(
            DropKind.MALFORMED_EVENT,
            f"token id out of range [0, 2**32): min {min(tokens)}, max {max(tokens)}",
        )
    return tokens


def _opt_int(value: Any, name: str) -> int | None:
    if value is None or _is_int(value):
        return value  # type: ignore[no-any-return]
    raise _Refused(DropKind.MALFORMED_EVENT, f"{name} is {type(value).__name__}, not an int")


def _opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _Refused(DropKind.MALFORMED_EVENT, f"{name} is {type(value).__name__}, not a string")


class EventDecoder:
    """Turns wire payloads into ``EventBatch`` structs, counting everything it refuses.

    One decoder serves many workers (``worker_id`` is passed per call); it holds no per-worker event state, only
    the typed decoders and a per-worker hint of which one matched last. Not thread-safe.

    Args:
        counters: where refusals are counted (shared with the subscriber that owns this decoder).
    """

    def __init__(self, counters: EventCounters) -> None:
        self.counters = counters
        self._map_decoder = msgspec.msgpack.Decoder(_MapBatch)
        self._array_decoder = msgspec.msgpack.Decoder(_ArrayBatch)
        self._raw_decoder = msgspec.msgpack.Decoder()
        self._prefer_array: dict[str, bool] = {}
        self._media: dict[str, Medium | None] = {}

    # -- entry point ------------------------------------------------------------------------------------------

    def decode(
        self,
        payload: bytes | memoryview,
        *,
        worker_id: str,
        seq: int,
        block_size: int | None = None,
        default_dp_rank: int = 0,
    ) -> EventBatch | None:
        """Decode and validate one payload.

        Args:
            payload: the msgpack payload frame.
            worker_id: the worker that published it (for attribution and counting).
            seq: the batch's sequence number (copied into the result).
            block_size: the worker's configured GPU block size in tokens, or ``None`` to accept any.
            default_dp_rank: the rank to use when the batch carries none.

        Returns:
            The batch with every valid event, in wire order (possibly none), or ``None`` when the payload as a
            whole is unusable (counted as ``MALFORMED_PAYLOAD``).
        """
        prefer_array = self._prefer_array.get(worker_id, False)
        first, second = (
            (self._array_decoder, self._map_decoder) if prefer_array else (self._map_decoder, self._array_decoder)
        )
        fast: _MapBatch | _ArrayBatch | None = None
        try:
            fast = first.decode(payload)
        except msgspec.DecodeError:
            try:
                fast = second.decode(payload)
                self._prefer_array[worker_id] = not prefer_array
            except msgspec.DecodeError:
                fast = None
        if fast is not None:
            events = self._normalize_fast(fast.events, worker_id, block_size)
            dp_rank = fast.data_parallel_rank
            ts_s = fast.ts
        else:
            raw = self._decode_raw(payload, worker_id, block_size)
            if raw is None:
                return None
            ts_s, events, dp_rank = raw
        return EventBatch(
            worker_id=worker_id,
            dp_rank=default_dp_rank if dp_rank is None else dp_rank,
            seq=seq,
            ts_s=ts_s,
            events=tuple(events),
        )

    # -- shared validation ------------------------------------------------------------------------------------

    def _medium(self, value: str | None) -> Medium:
        if value is None:
            return Medium.GPU
        try:
            medium = self._media[value]
        except KeyError:
            medium = self._media[value] = normalize_medium(value)
        if medium is None:
            raise _Refused(DropKind.UNKNOWN_MEDIUM, f"medium {value!r}")
        return medium

    @staticmethod
    def _check_locality(locality: Any) -> None:
        if locality is not None and locality != "LOCAL":
            raise _Refused(DropKind.REMOTE_LOCALITY, f"locality {locality!r}")

    def _stored(
        self,
        expected_block_size: int | None,
        hashes: tuple[EngineBlockHash, ...],
        parent: EngineBlockHash | None,
        token_ids: tuple[int, ...],
        block_size: int,
        medium: Medium,
        lora_name: str | None,
        extra_keys: tuple[object, ...] | None,
        group_idx: int | None,
        kind: str | None,
        window: int | None,
    ) -> BlockStored:
        num_blocks = len(hashes)
        if num_blocks == 0:
            if token_ids and is_sparse_group(kind, 0 if group_idx is None else group_idx):
                raise _NothingStored  # every block of the range skipped (vLLM's tail-window mask)
            raise _Refused(DropKind.MALFORMED_EVENT, "BlockStored without block hashes")
        if len(set(hashes)) != num_blocks or (parent is not None and parent in hashes):
            raise _Refused(DropKind.REPEATED_HASH, f"BlockStored repeats a hash among {num_blocks} blocks")
        if medium is Medium.GPU:
            if block_size <= 0:
                raise _Refused(DropKind.MALFORMED_EVENT, f"GPU BlockStored with block_size {block_size}")
            if expected_block_size is not None and block_size != expected_block_size:
                raise _Refused(
                    DropKind.BLOCK_SIZE_MISMATCH,
                    f"GPU block_size {block_size}, worker configured with {expected_block_size}",
                )
            if len(token_ids) != block_size * num_blocks and not (
                len(token_ids) > block_size * num_blocks
                and len(token_ids) % block_size == 0
                and is_sparse_group(kind, 0 if group_idx is None else group_idx)
            ):
                raise _Refused(
                    DropKind.TOKEN_COUNT_MISMATCH,
                    f"{len(token_ids)} tokens for {num_blocks} blocks of {block_size}"
                    + ("" if kind is None else f" (kind {kind!r})"),
                )
        else:
            if block_size < 0:
                raise _Refused(DropKind.MALFORMED_EVENT, f"{medium} BlockStored with block_size {block_size}")
            if expected_block_size is not None and block_size % expected_block_size:
                raise _Refused(
                    DropKind.BLOCK_SIZE_MISMATCH,
                    f"{medium} block_size {block_size} is not a multiple of GPU block size {expected_block_size}",
                )
            if token_ids and len(token_ids) != block_size * num_blocks:
                raise _Refused(
                    DropKind.TOKEN_COUNT_MISMATCH,
                    f"{len(token_ids)} tokens for {num_blocks} {medium} blocks of {block_size}",
                )
        # Positional, in BlockStored's field order (cheaper than keywords on this per-event path).
        return BlockStored(
            hashes,
            parent,
            token_ids,
            block_size,
            medium,
            lora_name,
            extra_keys,
            0 if group_idx is None else group_idx,
            kind,
            window,
        )

    def _removed(
        self, worker_id: str, hashes: tuple[EngineBlockHash, ...], medium: Medium, group_idx: int | None
    ) -> BlockRemoved:
        if len(set(hashes)) != len(hashes):
            self.counters.drop(worker_id, DropKind.REPEATED_HASH, "BlockRemoved repeats a hash; kept once each")
            hashes = tuple(dict.fromkeys(hashes))
        return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0 if group_idx is None else group_idx)

    def _cleared(self, medium: Any) -> AllBlocksCleared:
        if medium is None:
            return AllBlocksCleared()
        return AllBlocksCleared(medium=self._medium(_opt_str(medium, "medium")))

    # -- typed fast path --------------------------------------------------------------------------------------

    def _normalize_fast(self, wire_events: list[Any], worker_id: str, block_size: int | None) -> list[KVEvent]:
        out: list[KVEvent] = []
        append = out.append
        for ev in wire_events:
            try:
                if isinstance(ev, _FAST_STORED):
                    self._check_locality(ev.locality)
                    hashes = ev.block_hashes
                    if hashes and min(hashes) < 0:
                        hashes = tuple(h & U64_MASK for h in hashes)
                    parent = ev.parent_block_hash
                    if parent is not None and parent < 0:
                        parent &= U64_MASK
                    extra = ev.extra_keys
                    append(
                        self._stored(
                            block_size,
                            hashes,  # type: ignore[arg-type]  # u64 ints are EngineBlockHash
                            parent,  # type: ignore[arg-type]
                            ev.token_ids,
                            ev.block_size,
                            self._medium(ev.medium),
                            ev.lora_name,
                            None if extra is None else _freeze_extra_keys(extra),
                            ev.group_idx,
                            ev.kv_cache_spec_kind,
                            ev.kv_cache_spec_sliding_window,
                        )
                    )
                elif isinstance(ev, _FAST_REMOVED):
                    self._check_locality(ev.locality)
                    hashes = ev.block_hashes
                    if hashes and min(hashes) < 0:
                        hashes = tuple(h & U64_MASK for h in hashes)
                    append(self._removed(worker_id, hashes, self._medium(ev.medium), ev.group_idx))  # type: ignore[arg-type]
                else:
                    append(self._cleared(ev.medium))
            except _Refused as refused:
                self.counters.drop(worker_id, refused.kind, refused.detail)
            except _NothingStored:
                pass
        return out

    # -- untyped fallback -------------------------------------------------------------------------------------

    def _decode_raw(
        self, payload: bytes | memoryview, worker_id: str, block_size: int | None
    ) -> tuple[float, list[KVEvent], int | None] | None:
        try:
            obj = self._raw_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            self.counters.drop(worker_id, DropKind.MALFORMED_PAYLOAD, f"undecodable msgpack: {exc}")
            return None
        dp_rank: Any = None
        if isinstance(obj, list) and len(obj) >= 2:
            ts, wire_events = obj[0], obj[1]
            if len(obj) >= 3:
                dp_rank = obj[2]
            if len(obj) > 3:
                self.counters.drop(worker_id, DropKind.UNKNOWN_FIELD, f"outer batch of {len(obj)} elements")
        elif isinstance(obj, dict):
            ts, wire_events = obj.get("ts"), obj.get("events")
            for key in _BATCH_DP_KEYS:
                if obj.get(key) is not None:
                    dp_rank = obj[key]
                    break
            for key in obj:
                if key not in ("ts", "events") and key not in _BATCH_DP_KEYS:
                    self.counters.drop(worker_id, DropKind.UNKNOWN_FIELD, f"batch key {key!r}")
        else:
            self.counters.drop(worker_id, DropKind.MALFORMED_PAYLOAD, f"outer batch is {type(obj).__name__}")
            return None
        if not (_is_int(ts) or isinstance(ts, float)) or not isinstance(wire_events, list):
            self.counters.drop(worker_id, DropKind.MALFORMED_PAYLOAD, "outer batch without ts or events list")
            return None
        if dp_rank is not None and not _is_int(dp_rank):
            self.counters.drop(worker_id, DropKind.MALFORMED_PAYLOAD, f"dp rank of type {type(dp_rank).__name__}")
            return None
        events: list[KVEvent] = []
        for ev in wire_events:
            try:
                events.append(self._raw_event(ev, worker_id, block_size))
            except _Refused as refused:
                self.counters.drop(worker_id, refused.kind, refused.detail)
            except _NothingStored:
                pass
        return float(ts), events, dp_rank

    def _raw_fields(self, ev: Any, worker_id: str) -> tuple[str, dict[str, Any]]:
        if isinstance(ev, list):
            if not ev or not isinstance(ev[0], str):
                raise _Refused(DropKind.MALFORMED_EVENT, "array event without a string tag")
            tag = ev[0]
            names = _POSITIONAL.get(tag)
            if names is None:
                raise _Refused(DropKind.UNKNOWN_EVENT, f"event tag {tag!r}")
            values = ev[1:]
            if len(values) < _REQUIRED[tag]:
                raise _Refused(DropKind.MALFORMED_EVENT, f"{tag} with {len(values)} fields")
            if len(values) > len(names):
                self.counters.drop(worker_id, DropKind.UNKNOWN_FIELD, f"{tag} with {len(values)} positional fields")
            fields: dict[str, Any] = dict(zip(names, values, strict=False))
            if tag == "BlockStored" and isinstance(fields.get("lora_name"), dict):
                # SGLang BlockStoredWithMetadata: {"cache_salt": ...} sits in vLLM's lora_name slot.
                fields["lora_name"] = None
            return tag, fields
        if isinstance(ev, dict):
            map_tag = ev.get("type")
            if not isinstance(map_tag, str):
                raise _Refused(DropKind.MALFORMED_EVENT, "map event without a string 'type'")
            tag = map_tag
            names = _POSITIONAL.get(tag)
            if names is None:
                raise _Refused(DropKind.UNKNOWN_EVENT, f"event tag {tag!r}")
            for key in ev:
                if key not in names and key not in _IGNORED_KEYS:
                    self.counters.drop(worker_id, DropKind.UNKNOWN_FIELD, f"{tag} key {key!r}")
            for name in names[: _REQUIRED[tag]]:
                if name not in ev:
                    raise _Refused(DropKind.MALFORMED_EVENT, f"{tag} without {name!r}")
            return tag, ev
        raise _Refused(DropKind.MALFORMED_EVENT, f"event of type {type(ev).__name__}")

    def _raw_event(self, ev: Any, worker_id: str, block_size: int | None) -> KVEvent:
        tag, f = self._raw_fields(ev, worker_id)
        if tag == "AllBlocksCleared":
            return self._cleared(f.get("medium"))
        self._check_locality(f.get("locality"))
        medium = self._medium(_opt_str(f.get("medium"), "medium"))
        hashes = _raw_hashes(f["block_hashes"])
        group_idx = _opt_int(f.get("group_idx"), "group_idx")
        if group_idx is not None and group_idx < 0:
            raise _Refused(DropKind.MALFORMED_EVENT, f"negative group_idx {group_idx}")
        if tag == "BlockRemoved":
            return self._removed(worker_id, hashes, medium, group_idx)
        parent_raw = f["parent_block_hash"]
        wire_block_size = f["block_size"]
        if not _is_int(wire_block_size):
            raise _Refused(DropKind.MALFORMED_EVENT, "block_size is not an int")
        return self._stored(
            block_size,
            hashes,
            None if parent_raw is None else _raw_hash(parent_raw),
            _raw_tokens(f["token_ids"]),
            wire_block_size,
            medium,
            _opt_str(f.get("lora_name"), "lora_name"),
            _freeze_extra_keys(f.get("extra_keys")),
            group_idx,
            _opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
            _opt_int(f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"),
        )

