"""Configuration of the prefix index and of cache groups (hybrid models).

Keys are snake_case, the field names (the gateway still accepts the old kebab-case spellings for one release,
``router.config_base``). Cache groups are declared here, never learned from events: a ``BlockStored`` or
``BlockRemoved`` whose ``group_idx`` the index does not declare is refused and counted
(``num_unknown_group_events``). A model without ``groups`` has one full-attention group, 0. Example (YAML ``index``
section, a Gemma-style model whose engine publishes group 0 for full attention and group 1 for a 4,096-token
sliding window)::

    index:
      groups:
        - {kind: full}
        - {kind: sliding_window, sliding_window_tokens: 4096}
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

import msgspec

from router.index.errors import IndexConfigError


class GroupKind(StrEnum):
    """How a KV-cache group turns held blocks into a usable prefix.

    * ``FULL``: full attention; a prefix of ``L`` blocks needs every block ``0..L-1``.
    * ``SLIDING_WINDOW``: needs only the blocks covering the last window before ``L``:
      ``ceil((window_tokens - 1) / block_size)`` blocks (vLLM's ``SlidingWindowManager`` rule), or all of
      ``0..L-1`` when ``L`` is shorter than that.
    * ``RECURRENT``: recurrent / compressed state (Mamba, linear attention); needs the checkpoint block ``L-1``.
    """

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"


class GroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV-cache group.

    Attributes:
        kind: the hit rule.
        sliding_window_tokens: window in tokens, required for ``SLIDING_WINDOW``.
    """

    kind: GroupKind = GroupKind.FULL
    """Hit rule of the group."""
    sliding_window_tokens: int | None = None
    """Window in tokens (sliding-window groups only)."""

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SLIDING_WINDOW and (
            self.sliding_window_tokens is None or self.sliding_window_tokens <= 0
        ):
            raise IndexConfigError("a sliding_window group needs sliding_window_tokens > 0")

    def num_window_blocks(self, block_size: int) -> int:
        """Blocks a sliding-window group needs at the end of a prefix (0 for other kinds)."""
        if self.kind is not GroupKind.SLIDING_WINDOW or self.sliding_window_tokens is None:
            return 0
        return -(-(self.sliding_window_tokens - 1) // block_size)


class IndexConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Settings of one ``PrefixIndex``.

    Attributes:
        block_size: tokens per block of the index (must equal the engines' GPU block size, or divide it).
        max_blocks: cap on indexed blocks (entries, all workers together); above it the least recently stored
            leaves are pruned.
        prune_target_ratio: pruning stops at ``max_blocks * prune_target_ratio`` blocks (hysteresis).
        approx_ttl_s: lifetime in seconds of a block inserted by a routing decision (approximate mode); finite.
        approx_max_blocks: cap on approximate (unconfirmed) blocks; the oldest go first above it.
        max_parked_events_per_worker: ``BlockStored`` events whose parent is not yet known, kept per worker and
            dp_rank until the parent arrives (oldest dropped beyond it; 0 disables parking).
        groups: the model's KV-cache groups in the engine's order (``group_idx`` = position); empty for one
            full-attention group 0. Events of any other group are refused.
    """

    block_size: Annotated[int, msgspec.Meta(gt=0)] = 16
    """Tokens per block."""
    max_blocks: Annotated[int, msgspec.Meta(gt=0)] = 4_194_304
    """Cap on indexed blocks."""
    prune_target_ratio: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8
    """Fraction of ``max_blocks`` pruning brings the index down to."""
    approx_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    """Seconds an approximate block lives unless an event confirms it."""
    approx_max_blocks: Annotated[int, msgspec.Meta(gt=0)] = 1_048_576
    """Cap on approximate blocks."""
    max_parked_events_per_worker: Annotated[int, msgspec.Meta(ge=0)] = 1024
    """Events waiting for their parent, per worker and dp_rank."""
    groups: tuple[GroupSpec, ...] = ()
    """Cache groups by index (hybrid models); empty: group 0 only, full attention."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise IndexConfigError(f"block_size must be positive, got {self.block_size}")
        if self.max_blocks <= 0:
            raise IndexConfigError(f"max_blocks must be positive, got {self.max_blocks}")
        if not 0.0 < self.prune_target_ratio <= 1.0:
            raise IndexConfigError(f"prune_target_ratio must be in (0, 1], got {self.prune_target_ratio}")
        if not math.isfinite(self.approx_ttl_s):  # msgspec's gt=0 lets infinity through
            raise IndexConfigError(f"approx_ttl_s must be a finite number, got {self.approx_ttl_s}")
        if not self.approx_ttl_s > 0.0:
            raise IndexConfigError(f"approx_ttl_s must be positive, got {self.approx_ttl_s}")
        if self.approx_max_blocks <= 0:
            raise IndexConfigError(f"approx-max_blocks must be positive, got {self.approx_max_blocks}")
        if self.max_parked_events_per_worker < 0:
            raise IndexConfigError(
                f"max_parked_events_per_worker must be >= 0, got {self.max_parked_events_per_worker}"
            )
