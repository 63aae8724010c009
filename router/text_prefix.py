"""Incremental tokenization of text prompts (``/v1/completions``): an agent's prompt of turn ``k + 1`` starts with
its prompt of turn ``k``, so only the new text is tokenized.

A **checkpoint** is ``(prefix, state)``: ``prefix`` is an earlier prompt cut at a line start
(``common.line_split``), ``state`` the ``PromptState`` of ``prefix``'s tokens. A new prompt ``p`` uses the longest
checkpoint whose ``prefix`` it starts with, **checked**: ``p.startswith(prefix)`` (an exact string comparison) and
``len(prefix)`` a line start of ``p`` too (the character after it is not whitespace). With a tokenizer that composes at
line starts, ``encode(p) == encode(prefix) + encode(p[len(prefix):])`` exactly, so the state continues from the
checkpoint and only the rest is tokenized and hashed. Each prompt leaves a checkpoint at its own last line start
(which supersedes the one it used), so the next turn's new text is the last line of this one plus its own.

Lookup: checkpoints are bucketed by an xxh3 of the first ``anchor_chars`` characters (prompts shorter than that
are tokenized whole: they are cheap); a bucket keeps the ``bucket_size`` most recent, compared longest first.
Memory is bounded in checkpoints and in estimated bytes (the prefix string's and its state's; least recently used
first, the live sessions' up to ``max_bytes``, idle ones up to ``idle_max_bytes``: ``prompt_state.over_budget``).
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import xxhash

from common.line_split import is_line_start
from router.prompt_state import IDLE_S, PromptState, over_budget, state_size_bytes


class TextCheckpoint(msgspec.Struct, frozen=True, gc=False):
    """An earlier prompt's prefix, cut at a line start, and the state of its tokens.

    Attributes:
        prefix: the text (``len(prefix)`` characters, a line start of the prompt it was cut from).
        state: ``PromptState`` of ``prefix``'s tokens.
    """

    prefix: str
    state: PromptState

    @property
    def size_bytes(self) -> int:
        """Estimated bytes: the prefix string (``sys.getsizeof``, exact) and its state (``state_size_bytes``)."""
        return sys.getsizeof(self.prefix) + state_size_bytes(self.state)


class _Entry:
    """A checkpoint, its bucket and when it was last used (mutable: see ``prompt_state._Entry``)."""

    __slots__ = ("checkpoint", "key", "used_s")

    def __init__(self, key: int, checkpoint: TextCheckpoint, used_s: float) -> None:
        self.key = key
        self.checkpoint = checkpoint
        self.used_s = used_s


class TextPrefixCache:
    """Bounded store of ``TextCheckpoint``s of text prompts (module docstring).

    Eviction: least recently used first, while there are more than ``max_entries`` checkpoints, more than
    ``max_bytes`` estimated bytes (``TextCheckpoint.size_bytes``), or more than ``idle_max_bytes`` with the least
    recently used checkpoint idle (unused for more than ``idle_s`` seconds; ``prompt_state.over_budget``); a
    checkpoint larger than ``max_bytes`` alone is not kept.

    Attributes:
        num_chars: characters of the cached prefixes.
        num_bytes: their estimated bytes.
    """

    def __init__(self, max_entries: int = 1024, max_bytes: int = 24 << 20, anchor_chars: int = 2048,
                 bucket_size: int = 16, *, idle_max_bytes: int | None = None, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args: as ``prompt_state.PrefixStateCache``'s, and ``anchor_chars``, ``bucket_size`` (module docstring)."""
        self.anchor_chars = anchor_chars
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._idle_max_bytes = max_bytes if idle_max_bytes is None else min(idle_max_bytes, max_bytes)
        self._idle_s = idle_s
        self._clock = clock
        self._bucket_size = bucket_size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._buckets: dict[int, list[int]] = {}
        self._next_id = 0
        self.num_chars = 0
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def anchor(self, prompt: str, seed: int) -> int | None:
        """The bucket key of ``prompt`` under ``seed`` (namespace and block size), ``None`` if it is too short."""
        if len(prompt) <= self.anchor_chars:
            return None
        return xxhash.xxh3_64_intdigest(prompt[: self.anchor_chars].encode("utf-8", "surrogatepass"), seed)

    def find(self, key: int, prompt: str) -> tuple[int, TextCheckpoint] | None:
        """The longest checkpoint of bucket ``key`` that ``prompt`` extends at a line start, with its id."""
        best: tuple[int, TextCheckpoint] | None = None
        best_entry: _Entry | None = None
        # A tokenizer thread plans a huge prompt while the loop may store or evict: read a copy of the bucket and
        # skip an entry evicted meanwhile (a checkpoint itself is immutable, so one read is always consistent).
        for entry_id in tuple(self._buckets.get(key, ())):
            entry = self._entries.get(entry_id)
            if entry is None:
                continue
            checkpoint = entry.checkpoint
            n = len(checkpoint.prefix)
            if ((best is None or n > len(best[1].prefix)) and n < len(prompt) and prompt.startswith(checkpoint.prefix)
                    and is_line_start(prompt, n)):
                best, best_entry = (entry_id, checkpoint), entry
        if best is None or best_entry is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
            best_entry.used_s = self._clock()
            try:
                self._entries.move_to_end(best[0])
            except KeyError:  # evicted by the loop since it was read (see above): still a valid checkpoint
                pass
        return best

    def put(self, key: int, checkpoint: TextCheckpoint, superseded_id: int | None = None) -> None:
        """Store ``checkpoint`` in bucket ``key``; ``superseded_id`` (the checkpoint it extends) is dropped."""
        if superseded_id is not None and superseded_id in self._entries:
            self._remove(superseded_id)
        entry_id = self._next_id
        self._next_id += 1
        now_s = self._clock()
        self._entries[entry_id] = _Entry(key, checkpoint, now_s)
        bucket = self._buckets.setdefault(key, [])
        bucket.append(entry_id)
        self.num_chars += len(checkpoint.prefix)
        self.num_bytes += checkpoint.size_bytes
        if len(bucket) > self._bucket_size:
            self._remove(bucket[0])
        entries = self._entries
        while entries and (len(entries) > self._max_entries or over_budget(
                self.num_bytes, self._max_bytes, self._idle_max_bytes, next(iter(entries.values())).used_s, now_s,
                self._idle_s)):
            self._remove(next(iter(entries)))

    def clear(self) -> None:
        """Drop every checkpoint (counters stay)."""
        self._entries.clear()
        self._buckets.clear()
        self.num_chars = 0
        self.num_bytes = 0

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        key, checkpoint = entry.key, entry.checkpoint
        self.num_chars -= len(checkpoint.prefix)
        self.num_bytes -= checkpoint.size_bytes
        bucket = self._buckets[key]
        bucket.remove(entry_id)
        if not bucket:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._entries)
