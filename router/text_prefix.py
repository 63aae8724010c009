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
first).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import msgspec
import xxhash

from common.line_split import is_line_start
from router.prompt_state import PromptState, state_size_bytes


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


class TextPrefixCache:
    """Bounded store of ``TextCheckpoint``s of text prompts (module docstring).

    Eviction: least recently used first, until at most ``max_entries`` checkpoints and ``max_bytes`` estimated bytes
    (``TextCheckpoint.size_bytes``); a checkpoint larger than ``max_bytes`` alone is not kept.

    Attributes:
        num_chars: characters of the cached prefixes.
        num_bytes: their estimated bytes.
    """

    def __init__(self, max_entries: int = 1024, max_bytes: int = 24 << 20, anchor_chars: int = 2048,
                 bucket_size: int = 16) -> None:
        self.anchor_chars = anchor_chars
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bucket_size = bucket_size
        self._entries: OrderedDict[int, tuple[int, TextCheckpoint]] = OrderedDict()
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
        # A tokenizer thread plans a huge prompt while the loop may store or evict: read a copy of the bucket and
        # skip an entry evicted meanwhile (a checkpoint itself is immutable, so one read is always consistent).
        for entry_id in tuple(self._buckets.get(key, ())):
            entry = self._entries.get(entry_id)
            if entry is None:
                continue
            checkpoint = entry[1]
            n = len(checkpoint.prefix)
            if ((best is None or n > len(best[1].prefix)) and n < len(prompt) and prompt.startswith(checkpoint.prefix)
                    and is_line_start(prompt, n)):
                best = (entry_id, checkpoint)
        if best is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
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
        self._entries[entry_id] = (key, checkpoint)
        bucket = self._buckets.setdefault(key, [])
        bucket.append(entry_id)
        self.num_chars += len(checkpoint.prefix)
        self.num_bytes += checkpoint.size_bytes
        if len(bucket) > self._bucket_size:
            self._remove(bucket[0])
        while self._entries and (len(self._entries) > self._max_entries or self.num_bytes > self._max_bytes):
            self._remove(next(iter(self._entries)))

    def clear(self) -> None:
        """Drop every checkpoint (counters stay)."""
        self._entries.clear()
        self._buckets.clear()
        self.num_chars = 0
        self.num_bytes = 0

    def _remove(self, entry_id: int) -> None:
        key, checkpoint = self._entries.pop(entry_id)
        self.num_chars -= len(checkpoint.prefix)
        self.num_bytes -= checkpoint.size_bytes
        bucket = self._buckets[key]
        bucket.remove(entry_id)
        if not bucket:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._entries)
