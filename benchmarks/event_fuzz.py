"""Coverage-guided fuzzing of the KV event decoder (``events.decode``) and the index it feeds, with atheris.

Not a speed figure: it prints case counts and findings. atheris (libFuzzer for Python) instruments ``events`` and
``router.index`` and mutates payload frames, starting from the wire captures of vLLM (map and array batches, the
oldest 2-field shape, a Gemma-3 hybrid capture) and SGLang (one store per page, signed hashes) in
``tests/fixtures/events``. The input's first byte picks what the rest is (``atheris.FuzzedDataProvider``):

    even            a raw payload (libFuzzer's byte mutations), decoded by one ``EventDecoder``
    1 mod 4         a batch built field by field: a vLLM- or SGLang-shaped outer batch whose events mix valid and
                    broken fields, decoded the same way
    3 mod 4         a whole ZMQ message ``[topic, seq, payload]`` (or a broken one: another frame count, a seq
                    frame of another length, a seq repeated, going back or jumping, a topic naming no added worker)
                    handed to a ``KVEventSubscriber``'s reader (``FrameFeed``), whose rank streams sequence it,
                    resync on gaps and deliver into the index

The decoder and the subscriber count into one ``EventCounters``; every decoded batch and every subscriber record
goes into one ``PrefixIndex``. A finding is any of::

    an exception out of decode or apply      (the decoder and the index never raise on input)
    a traceback logged under ``events``       (a rank stream that failed, a sink that raised)
    a stream the subscriber was not told of  (only the added (worker, dp_rank) pairs get one)
    a refused payload not counted            (decode returned None and no drop was added)
    an event outside its invariants          (hashes unique and < 2**64, token ids < 2**32, GPU stores of
                                              block_size tokens a block, or a multiple for a sparse group)
    the index's check_invariants failing     (every 512 inputs and at the end; the index is reset by a Resync
                                              every 4,096 inputs so that its size stays bounded)

libFuzzer stops at the first finding and writes the input as ``crash-<sha1>`` (``-artifact_prefix``).

``python -m benchmarks event_fuzz --max-total-time-s 600`` (or ``--runs N``); ``tests/events/test_event_fuzz.py``
runs it for a few seconds in CI. Without atheris (it ships Linux x86-64 wheels only) the hypothesis fuzzer in
``tests/events/test_decode_fuzz.py`` is the fallback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BLOCK_SIZE = 4
CHECK_EVERY = 512
RESET_EVERY = 4096
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "events"

_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "Bogus")
_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                           "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
           "BlockRemoved": ("block_hashes", "medium", "group_idx"), "AllBlocksCleared": ("medium",),
           "Bogus": ("x",)}
_MEDIA = ("GPU", "CPU", "cpu", "DISK", "MOONCAKE", "L3", "bogus")


def seed_payloads() -> list[bytes]:
    """The captured and hand-written vLLM / SGLang payloads of ``tests/fixtures/events``."""
    seeds = [path.read_bytes() for path in sorted(FIXTURES.glob("*.msgpack"))]
    try:
        from tests.fixtures.events import payloads
    except ImportError:  # run outside a checkout: the captures only
        return seeds
    for name in sorted(dir(payloads)):
        value = getattr(payloads, name)
        if name.isupper() and isinstance(value, bytes) and value[:1] and (value[0] & 0xE0 == 0x80):
            seeds.append(value)  # a batch (a msgpack fixarray or fixmap), not a seq frame or a single value
    return seeds


def _value(fdp: Any, depth: int = 0) -> Any:
    """An arbitrary msgpack value drawn from the input (bounded depth and size)."""
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(2**63), 2**64 - 1)
    if kind == 3:
        return fdp.ConsumeIntInRange(-3, 40)
    if kind == 4:
        return fdp.ConsumeRegularFloat()
    if kind == 5:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 6:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 12))
    if kind in (7, 8):
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {fdp.ConsumeUnicodeNoSurrogates(4): _value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}


def _field(fdp: Any, name: str) -> Any:
    """A plausible value for one event field, or (one time in four) any value."""
    if fdp.ConsumeIntInRange(0, 3) == 0:
        return _value(fdp)
    if name == "block_hashes":
        return [fdp.ConsumeIntInRange(-(2**63), 2**64 - 1) if fdp.ConsumeBool() else fdp.ConsumeBytes(8)
                for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if name == "parent_block_hash":
        return None if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 2**64 - 1)
    if name == "token_ids":
        n = fdp.ConsumeIntInRange(0, 3) * BLOCK_SIZE + fdp.ConsumeIntInRange(0, 1)
        return [fdp.ConsumeIntInRange(-1, 2**33) if fdp.ConsumeIntInRange(0, 7) == 0 else fdp.ConsumeIntInRange(0, 99)
                for _ in range(n)]
    if name == "block_size":
        return BLOCK_SIZE if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-1, 16)
    if name == "medium":
        return None if fdp.ConsumeIntInRange(0, 3) == 0 else fdp.PickValueInList(list(_MEDIA))
    if name == "group_idx":
        return fdp.ConsumeIntInRange(-1, 2)
    if name == "kv_cache_spec_kind":
        return fdp.PickValueInList(["full_attention", "sliding_window", "mamba", "other"])
    return _value(fdp)


def _may_skip_uncounted(event: Any) -> bool:
    """A store naming no block but some tokens: the decoder skips it uncounted when its group is sparse (vLLM's
    sliding-window tail, ``events.decode``), so it need not be returned or counted."""
    if isinstance(event, dict):
        tag, hashes, tokens = event.get("type"), event.get("block_hashes"), event.get("token_ids")
    else:
        tag, hashes, tokens = event[0], (event[1:2] or [None])[0], (event[3:4] or [None])[0]
    return tag == "BlockStored" and hashes == [] and isinstance(tokens, list) and bool(tokens)


def structured_payload(data: bytes) -> tuple[bytes, int]:
    """A batch built from ``data``: (msgpack payload, number of its events that must each be returned or counted;
    sparse stores naming no block are left out)."""
    import atheris
    import msgspec

    fdp = atheris.FuzzedDataProvider(data)
    events: list[Any] = []
    for _ in range(fdp.ConsumeIntInRange(0, 5)):
        tag = fdp.PickValueInList(list(_TAGS))
        names = _FIELDS[tag][: fdp.ConsumeIntInRange(0, len(_FIELDS[tag]))]
        fields = [_field(fdp, name) for name in names]
        if fdp.ConsumeBool():  # vLLM <= 0.23 and SGLang: a tagged array
            events.append([tag, *fields])
        else:  # vLLM >= 0.24: a tagged map
            events.append({"type": tag, **dict(zip(names, fields, strict=True))})
    ts: Any = fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else _value(fdp)
    rank: Any = fdp.ConsumeIntInRange(-1, 2) if fdp.ConsumeBool() else _value(fdp)
    shape = fdp.ConsumeIntInRange(0, 3)
    outer: Any = ([ts, events], [ts, events, rank], {"ts": ts, "events": events, "data_parallel_rank": rank},
                  events)[shape]
    return msgspec.msgpack.encode(outer), sum(not _may_skip_uncounted(e) for e in events)


_TOPICS = (b"kv@w2@m", b"kv@w2@m\x00sgl-kv-epoch=7", b"kv@nobody@m", b"kv@", b"kv@@m", b"other@w2", b"\xff\xfe")


def message_frames(data: bytes, next_seq: int) -> tuple[bool, list[bytes]]:
    """A ZMQ message built from ``data``: (whether it arrives on the bound SUB, its frames ``[topic, seq, payload]``
    as vLLM and SGLang publish them, or a broken variant: another frame count, a seq frame of another length, a
    seq that repeats, goes back or jumps, a topic naming no added worker)."""
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    is_bound = fdp.ConsumeBool()
    topic = fdp.PickValueInList(list(_TOPICS)) if is_bound and fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeBytes(
        fdp.ConsumeIntInRange(0, 12))
    pick = fdp.ConsumeIntInRange(0, 7)
    if pick <= 3:
        seq = (next_seq % 2**64).to_bytes(8, "big")
    elif pick == 4:
        seq = max(0, next_seq - fdp.ConsumeIntInRange(1, 3)).to_bytes(8, "big")
    elif pick == 5:
        seq = ((next_seq + fdp.ConsumeIntInRange(1, 3)) % 2**64).to_bytes(8, "big")
    elif pick == 6:
        seq = fdp.ConsumeBytes(8).rjust(8, b"\x00")
    else:
        seq = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 9))
    num_frames = fdp.PickValueInList([3, 3, 3, 3, 3, 1, 2, 4])
    rest = fdp.ConsumeBytes(fdp.remaining_bytes())
    payload = structured_payload(rest)[0] if rest[:1] and rest[0] & 1 else rest[1:]
    frames = [topic, seq, payload, b"extra"][:num_frames] if num_frames <= 4 else []
    return is_bound, frames


class _Tracebacks(logging.Handler):
    """Every record with a traceback logged under ``events`` (a stream that failed, a sink that raised)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


class FrameFeed:
    """A ``KVEventSubscriber`` fed whole messages without sockets, on its own event loop: its reader's
    ``_on_message`` (as the socket loop calls it) for the connect topology (worker ``w``, rank 0, no replay
    endpoint, so a gap resyncs) and the bound one (worker ``w2`` with ranks 0 and 1, named by the topic), its
    rank streams sequencing into a ``PrefixIndex``."""

    def __init__(self, counters: Any, index: Any) -> None:
        import asyncio

        from events.subscriber import KVEventSubscriber, SubscriberConfig, WorkerSpec
        from events.subscriber import _Source as Source  # the reader's own record of a socket (no socket here)
        from events.types import EventBatch

        self.loop = asyncio.new_event_loop()
        self.index = index
        self.num_records = 0

        def sink(record: Any) -> None:
            self.num_records += 1
            if isinstance(record, EventBatch):
                index.apply(record)
            else:
                index.apply_resync(record)

        self.sub = KVEventSubscriber(SubscriberConfig(default_block_size=BLOCK_SIZE, max_pending_batches=4), sink,
                                     counters=counters)
        spec = WorkerSpec(worker_id="w", block_size=BLOCK_SIZE)
        for worker_spec in (spec, WorkerSpec(worker_id="w2"), WorkerSpec(worker_id="w2", dp_rank=1)):
            self.sub.add_worker(worker_spec)
        self.connect = Source(endpoint="fuzz-connect", worker_id="w", socket=None, monitor=None, spec=spec)  # type: ignore[arg-type]
        self.bound = Source(endpoint="fuzz-bound", worker_id=None, socket=None, monitor=None)  # type: ignore[arg-type]
        self.tracebacks = _Tracebacks()
        logging.getLogger("events").addHandler(self.tracebacks)

    def next_seq(self) -> int:
        last = self.sub.last_seq("w")
        return 0 if last is None else last + 1

    def feed(self, is_bound: bool, frames: list[bytes]) -> None:
        """Deliver one message and let every stream finish with it."""
        import asyncio

        async def deliver() -> None:
            await self.sub._on_message(self.bound if is_bound else self.connect, frames)
            for _ in range(64):  # the stream tasks take their items; a few more turns to apply the last one
                await asyncio.sleep(0)
                if all(s.queue.empty() for s in self.sub._streams.values()):
                    break
            for _ in range(3):
                await asyncio.sleep(0)

        self.loop.run_until_complete(deliver())
        assert not self.tracebacks.records, self.tracebacks.records[0].getMessage()
        assert set(self.sub._streams) <= {("w", 0), ("w2", 0), ("w2", 1)}, sorted(self.sub._streams)


class EventFuzzer:
    """One decoder and one index fed input after input; ``one_input`` raises ``AssertionError`` on a finding."""

    def __init__(self, *, max_total_time_s: float = float("inf"), max_runs: int = -1) -> None:
        from events.counters import EventCounters
        from events.decode import EventDecoder
        from router.index import IndexConfig, PrefixIndex

        self.counters = EventCounters()
        self.decoder = EventDecoder(self.counters)
        self.index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE))
        self.num_inputs = 0
        self.num_structured = 0
        self.num_decoded = 0
        self.num_refused = 0
        self.num_events = 0
        self.num_index_checks = 0
        self.num_messages = 0
        self.frames = FrameFeed(self.counters, self.index)
        self.max_runs = max_runs
        self.end_s = time.monotonic() + max_total_time_s

    def one_input(self, data: bytes) -> None:
        from events.types import EventBatch

        self.num_inputs += 1
        if data[:1] and data[0] & 3 == 3:  # a whole message through the subscriber
            self.num_messages += 1
            is_bound, frames = message_frames(data[1:], self.frames.next_seq())
            self.frames.feed(is_bound, frames)
            self._upkeep()
            return
        if data[:1] and data[0] & 1:
            self.num_structured += 1
            payload, num_input_events = structured_payload(data[1:])
        else:
            payload, num_input_events = data[1:], 0
        drops_before = self.counters.total_drops()
        batch = self.decoder.decode(payload, worker_id="w", seq=self.num_inputs, block_size=BLOCK_SIZE)
        num_drops = self.counters.total_drops() - drops_before
        if batch is None:
            self.num_refused += 1
            assert num_drops >= 1, f"a refused payload was not counted: {payload[:80]!r}"
        else:
            assert isinstance(batch, EventBatch)
            self.num_decoded += 1
            self.num_events += len(batch.events)
            check_events(batch)
            # every input event is returned or counted (the one silent skip: a sparse store naming no block)
            assert len(batch.events) + num_drops >= num_input_events, (
                f"{num_input_events} events in, {len(batch.events)} out, {num_drops} counted: {payload[:120]!r}")
            self.index.apply(batch)
        self._upkeep()

    def _upkeep(self) -> None:
        from events.types import Resync

        if self.num_inputs % CHECK_EVERY == 0:
            self.check_index()
        if self.num_inputs % RESET_EVERY == 0:
            for worker_id in ("w", "w2"):
                self.index.apply_resync(Resync(worker_id=worker_id, reason="fuzz_reset", dp_rank=None))
            self.check_index()
        if self.num_inputs == self.max_runs or (self.num_inputs % 64 == 0 and time.monotonic() >= self.end_s):
            self.finish()

    def finish(self) -> None:
        """The last index check and the summary, then exit 0 (libFuzzer's own exit skips Python's ``atexit``)."""
        self.check_index()
        print(self.summary(), flush=True)
        sys.stderr.flush()
        os._exit(0)

    def check_index(self) -> None:
        self.num_index_checks += 1
        self.index.check_invariants()

    def summary(self) -> str:
        kinds = ", ".join(f"{kind.value} {n}" for kind, n in sorted(self.counters.drops_by_kind().items()))
        return (f"event fuzz: {self.num_inputs} inputs ({self.num_structured} structured, {self.num_messages} "
                f"messages through the subscriber giving {self.frames.num_records} records and "
                f"{sum(self.counters.resyncs.values())} resyncs), {self.num_decoded} "
                f"decoded with {self.num_events} events, {self.num_refused} refused; "
                f"{self.counters.total_drops()} drops counted ({kinds or 'none'}); "
                f"{self.num_index_checks} index invariant checks passed")


def check_events(batch: Any) -> None:
    """The invariants every event the decoder returns keeps (``events.types``)."""
    from events.types import BlockRemoved, BlockStored, Medium, is_sparse_group

    for event in batch.events:
        if isinstance(event, BlockStored):
            assert len(set(event.block_hashes)) == len(event.block_hashes) > 0, event
            assert all(0 <= h < 2**64 for h in event.block_hashes), event
            assert all(0 <= t < 2**32 for t in event.token_ids), event
            if event.medium is Medium.GPU:  # a sparse group's store may span more blocks than it names
                expected = BLOCK_SIZE * len(event.block_hashes)
                if is_sparse_group(event.kv_cache_spec_kind, event.group_idx):
                    assert len(event.token_ids) >= expected and len(event.token_ids) % BLOCK_SIZE == 0, event
                else:
                    assert len(event.token_ids) == expected, event
        elif isinstance(event, BlockRemoved):
            assert len(set(event.block_hashes)) == len(event.block_hashes), event


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks event_fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--max-total-time-s", type=float, default=600.0, help="stop after this many seconds")
    parser.add_argument("--runs", type=int, default=-1, help="inputs to run (-1: until the time is up)")
    parser.add_argument("--corpus", default=None, help="corpus directory (kept; default a temporary one)")
    parser.add_argument("--artifact-prefix", default="./", help="where a crashing input is written")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.max_total_time_s > 0:
        parser.error("--max-total-time-s must be > 0")
    try:
        import atheris
    except ImportError:
        print("event_fuzz needs atheris (pip install atheris; Linux x86-64 wheels)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.ERROR)  # each drop kind's first warning would flood the fuzzer's output
    with atheris.instrument_imports(include=["events", "router.index"]):
        import events.decode  # noqa: F401
        import events.rank_stream  # noqa: F401
        import events.subscriber  # noqa: F401
        import router.index  # noqa: F401
    fuzzer = EventFuzzer(max_total_time_s=args.max_total_time_s, max_runs=args.runs)
    corpus = Path(args.corpus) if args.corpus else Path(tempfile.mkdtemp(prefix="kv-event-corpus-"))
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seed_payloads()):  # even first byte: the raw payload itself
        (corpus / f"seed-{i:02d}").write_bytes(b"\x00" + seed)
    libfuzzer_args = [sys.argv[0], f"-seed={args.seed}", f"-artifact_prefix={args.artifact_prefix}", str(corpus)]
    atheris.Setup(libfuzzer_args, fuzzer.one_input)
    try:
        atheris.Fuzz()  # returns never: ``finish`` exits 0 at the budget; a finding exits non-zero with its input
    finally:
        print(fuzzer.summary(), flush=True)  # reached on a finding (the uncaught exception unwinds through here)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
