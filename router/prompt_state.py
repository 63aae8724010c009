"""The tokenized and hashed state of a prompt prefix, extended block by block, and the routing view of a prompt
with the plan that builds it (``router.request_view`` and ``router.text_prefix`` build on them)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import xxhash

from router.block_hash import BlockHash, Namespace, hash_token_blocks, tokens_to_bytes


class PromptState(msgspec.Struct, frozen=True, gc=False):
    """Tokenized and hashed prefix of a prompt.

    Attributes:
        num_tokens: tokens in the prefix.
        block_hashes: chained hashes of its full blocks, root-most first (``num_tokens // block_size`` items).
        tail: the tokens after the last full block (fewer than ``block_size``).
        opening_hash: identity of the conversation's opening (system prompt and first user message): the
            chained hash of its last full block, else an xxh3-64 of its tokens seeded by the namespace; ``None``
            until the opening is complete.
    """

    num_tokens: int
    block_hashes: tuple[BlockHash, ...]
    tail: tuple[int, ...]
    opening_hash: int | None = None


EMPTY_STATE = PromptState(0, (), ())

SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
"""xxh3 seeds are unsigned 64-bit: ``hash()`` values are masked to it."""


STATE_BYTES = 120
"""Estimated bytes of one ``PromptState`` besides its items: the struct, its two tuples' headers, a cache entry."""
BYTES_PER_BLOCK_HASH = 56
"""Estimated bytes per block hash of a ``PromptState``: its tuple slot (8) and its int (a 64-bit value, 36 bytes in
pymalloc's 48-byte class). A hash shared by several cached states is counted in each: the estimate is an upper
bound, as a byte budget should be."""
BYTES_PER_TAIL_TOKEN = 40
"""Estimated bytes per tail token: its tuple slot and an int (ids below 256 are shared, counted anyway)."""


def state_size_bytes(state: PromptState) -> int:
    """Estimated bytes ``state`` holds (``STATE_BYTES`` + ``BYTES_PER_BLOCK_HASH`` per block hash +
    ``BYTES_PER_TAIL_TOKEN`` per tail token): what the prompt-state caches count against their byte budgets. O(1)."""
    return STATE_BYTES + BYTES_PER_BLOCK_HASH * len(state.block_hashes) + BYTES_PER_TAIL_TOKEN * len(state.tail)


def extend_state(
    state: PromptState, token_ids: list[int] | tuple[int, ...], block_size: int, namespace: Namespace
) -> PromptState:
    """Append ``token_ids`` to ``state``, hashing only the blocks they complete.

    Args:
        state: the prefix so far.
        token_ids: the new tokens.
        block_size: tokens per block.
        namespace: chain seed (used when ``state`` has no full block yet).

    Returns:
        The extended state.
    """
    if not token_ids:
        return state
    if len(token_ids) > HASH_SLICE_TOKENS:
        return _extend_in_slices(state, token_ids, block_size, namespace)
    combined = state.tail + tuple(token_ids) if state.tail else tuple(token_ids)
    num_full = len(combined) // block_size * block_size
    if num_full == 0:
        return PromptState(state.num_tokens + len(token_ids), state.block_hashes, combined, state.opening_hash)
    parent = state.block_hashes[-1] if state.block_hashes else None
    new_hashes = hash_token_blocks(combined[:num_full], block_size, namespace, parent)
    return PromptState(
        state.num_tokens + len(token_ids), state.block_hashes + tuple(new_hashes), combined[num_full:],
        state.opening_hash,
    )


HASH_SLICE_TOKENS = 65_536
"""``extend_state`` copies, serializes and hashes a longer run of tokens this many at a time: each C call it makes
(a copy, ``tokens_to_bytes``, the cut into blocks) then holds the GIL for about a millisecond, so a huge prompt
built in a tokenizer thread (``ModelTokenizer.view_async``) lets the event loop run between them; whole, the 3.5M
tokens of a 15 MB prompt held it for up to 1.7 s on a busy 2-core host (``python -m benchmarks huge_prompt``)."""


def _extend_in_slices(
    state: PromptState, token_ids: list[int] | tuple[int, ...], block_size: int, namespace: Namespace
) -> PromptState:
    """``extend_state`` for more than ``HASH_SLICE_TOKENS`` tokens: the same state, ``HASH_SLICE_TOKENS`` at a
    time (the chain continues from each slice's last hash; a partial block carries over to the next slice)."""
    new_hashes: list[BlockHash] = []
    parent = state.block_hashes[-1] if state.block_hashes else None
    carry: list[int] = list(state.tail)
    for start in range(0, len(token_ids), HASH_SLICE_TOKENS):
        chunk = list(token_ids[start:start + HASH_SLICE_TOKENS])
        if carry:
            chunk = carry + chunk
        num_full = len(chunk) // block_size * block_size
        if num_full:
            hashes = hash_token_blocks(chunk if num_full == len(chunk) else chunk[:num_full], block_size, namespace,
                                       parent)
            new_hashes.extend(hashes)
            parent = hashes[-1]
        carry = chunk[num_full:]
    return PromptState(state.num_tokens + len(token_ids), state.block_hashes + tuple(new_hashes), tuple(carry),
                       state.opening_hash)


def with_opening_hash(state: PromptState, namespace: Namespace) -> PromptState:
    """``state`` with ``opening_hash`` set from its current end (see ``PromptState``)."""
    if state.block_hashes:
        opening: int = state.block_hashes[-1]
    else:
        opening = xxhash.xxh3_64_intdigest(tokens_to_bytes(state.tail), namespace)
    return PromptState(state.num_tokens, state.block_hashes, state.tail, opening)


class PromptView(msgspec.Struct, frozen=True, gc=False):
    """The routing view of one prompt.

    Attributes:
        num_tokens: prompt tokens.
        block_hashes: chained hashes of the full blocks.
        block_size: tokens per block.
        num_reused_blocks: blocks taken from the prefix cache (not re-hashed) this time.
        opening_hash: identity of a chat's opening (``PromptState.opening_hash``); ``None`` for completions.
    """

    num_tokens: int
    block_hashes: tuple[BlockHash, ...]
    block_size: int
    num_reused_blocks: int = 0
    opening_hash: int | None = None

    @property
    def num_cacheable_blocks(self) -> int:
        """Most blocks a worker can serve from cache: ``(num_tokens - 1) // block_size`` (vLLM's rule)."""
        return max(0, (self.num_tokens - 1) // self.block_size)


def _joined(parts: list[list[int]]) -> list[int]:
    if len(parts) == 1:
        return parts[0]
    out: list[int] = []
    for p in parts:
        out.extend(p)
    return out


Commit = Callable[[], None] | None
"""The prefix-cache writes a built view still owes (run on the event loop), or ``None``."""


class ViewPlan:
    """What one prompt still needs tokenized, and how its ids fold into the ``PromptView``.

    Attributes:
        texts: the texts to encode, in order (slices of groups, see ``build``).
        num_chars: their total length in characters.
    """

    __slots__ = ("_build", "_group_sizes", "num_chars", "texts")

    def __init__(self, groups: list[list[str]], build: Callable[[list[list[int]]], tuple[PromptView, Commit]]) -> None:
        self.texts = [t for g in groups for t in g]
        self.num_chars = sum(len(t) for t in self.texts)
        self._group_sizes = [len(g) for g in groups]
        self._build = build

    def build(self, ids: Sequence[list[int]]) -> tuple[PromptView, Commit]:
        """The view from ``ids[i] = encode(texts[i])`` (the slices of each group joined first) and the cache
        writes it owes; pure (reads nothing that changes), so it may run in a worker thread."""
        grouped: list[list[int]] = []
        i = 0
        for n in self._group_sizes:
            grouped.append(_joined(list(ids[i: i + n])) if n else [])
            i += n
        return self._build(grouped)

    def finish(self, ids: Sequence[list[int]]) -> PromptView:
        """``build``, its cache writes made."""
        view, commit = self.build(ids)
        if commit is not None:
            commit()
        return view


IDLE_S = 300.0
"""Default seconds after its last use that a cached entry counts as idle (``PrefixStateCache``): an agent's session
waits on its tools and its user between turns, for seconds to minutes."""

SUPERSEDED_S = float("-inf")
"""The last-use time of an entry superseded by its session's newer one (``PrefixStateCache.put``): idle at once."""


def over_budget(num_bytes: int, max_bytes: int, idle_max_bytes: int, oldest_used_s: float, now_s: float,
                idle_s: float) -> bool:
    """Whether a prompt cache holding ``num_bytes`` (estimated) must evict its least recently used entry, last used
    at ``oldest_used_s``: it holds more than ``max_bytes``, or more than ``idle_max_bytes`` and that entry has been
    idle for more than ``idle_s`` seconds (an entry of a live session is kept up to ``max_bytes``)."""
    return num_bytes > max_bytes or (num_bytes > idle_max_bytes and now_s - oldest_used_s > idle_s)


class _Entry:
    """A cached state and when it was last used (mutable: a reader in a tokenizer thread stamps the object it read,
    so an entry the loop evicted meanwhile is not brought back)."""

    __slots__ = ("state", "used_s")

    def __init__(self, state: PromptState, used_s: float) -> None:
        self.state = state
        self.used_s = used_s


class PrefixStateCache:
    """Bounded LRU of conversation prefix states (``router.request_view``'s module docstring).

    Eviction: least recently used first, while the entry count is over ``max_entries``, the states' estimated size
    (``prompt_state.state_size_bytes``) over ``max_bytes``, or that size over ``idle_max_bytes`` with the least
    recently used entry idle (not used for more than ``idle_s`` seconds): the live sessions' states are kept up to
    ``max_bytes``, idle ones up to ``idle_max_bytes`` (``over_budget``). A state larger than ``max_bytes`` alone is
    not kept. Eviction runs on ``put`` (an idle cache keeps what it holds, at most ``max_bytes``).

    Attributes:
        num_bytes: estimated bytes of the cached states.
    """

    def __init__(self, max_entries: int = 4096, max_bytes: int = 32 << 20, *, idle_max_bytes: int | None = None,
                 idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            max_entries: most states kept.
            max_bytes: most estimated bytes kept.
            idle_max_bytes: most estimated bytes kept once the least recently used state is idle; ``None`` (or more
                than ``max_bytes``): ``max_bytes``.
            idle_s: seconds after its last use that a state is idle.
            clock: monotonic seconds (injected by tests).
        """
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._idle_max_bytes = max_bytes if idle_max_bytes is None else min(idle_max_bytes, max_bytes)
        self._idle_s = idle_s
        self._clock = clock
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: int) -> PromptState | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.used_s = self._clock()
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted meanwhile by the loop (a tokenizer thread planning a huge prompt reads)
            pass
        return entry.state

    def put(self, key: int, state: PromptState, superseded: int | None = None) -> None:
        """Store ``state`` under ``key``; ``superseded`` (the key of the state it continues, when its session has
        no more use for it but a client may still go back to it: an edited last message) becomes the least
        recently used, idle at once (``SUPERSEDED_S``)."""
        now_s = self._clock()
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self.num_bytes -= state_size_bytes(old.state)
        entries[key] = _Entry(state, now_s)
        self.num_bytes += state_size_bytes(state)
        if superseded is not None and superseded != key:
            previous = entries.get(superseded)
            if previous is not None:
                previous.used_s = SUPERSEDED_S
                entries.move_to_end(superseded, last=False)
        while entries and (len(entries) > self._max_entries or over_budget(
                self.num_bytes, self._max_bytes, self._idle_max_bytes, next(iter(entries.values())).used_s, now_s,
                self._idle_s)):
            self.num_bytes -= state_size_bytes(entries.popitem(last=False)[1].state)

    def clear(self) -> None:
        """Drop every state (counters stay)."""
        self._entries.clear()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)
