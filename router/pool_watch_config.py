"""The ``pool_watch:`` section of the gateway config (``router.pool_watch`` runs it).

The master of a Mooncake pool evicts silently and forgets everything when it restarts; its workers (vLLM's
Mooncake store connector) never publish the loss. The watcher reads the master's HTTP admin port (the
``--metrics_port`` of ``mooncake_master``) and drops the index's pool entries the master no longer holds.

YAML::

    pool_watch:
      admin_url: http://127.0.0.1:9003    # mooncake_master --metrics_port (serves /metrics, /get_all_keys, ...)
      lease_ttl_s: 5.0                    # the master's --default_kv_lease_ttl, in seconds
      interval_s: 1.0                     # one sweep (key listing + counters) every this long
      entry_ttl_s: 5.0                    # pool entries not confirmed for this long are dropped (<= lease_ttl_s)
      decision_check_budget_s: 0.002      # per decision: confirm the chosen worker's pool blocks within this
      pieces_per_block: 1                 # objects one block is stored as (vLLM: TP ranks x PP stages)
      blocks_per_span: 16                 # kvgate workers' kv-cache.pool.blocks-per-span (span keys of another
                                          # length are counted and logged)
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from router.config_base import NonNegativeSeconds, PositiveSeconds

__all__ = ["PoolWatchConfig"]


class PoolWatchConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``pool_watch:`` section (module docstring)."""

    admin_url: str
    """Base URL of the master's HTTP admin port (``/metrics``, ``/get_all_keys``, ``/batch_query_keys``)."""
    lease_ttl_s: PositiveSeconds = 5.0
    """The pool's lease (``mooncake_master --default_kv_lease_ttl``): how long an object stays readable after a
    lookup found it; the watcher's TTL may not be longer."""
    interval_s: PositiveSeconds = 1.0
    """One sweep every this long: the master's counters and its key listing, compared with the index."""
    entry_ttl_s: PositiveSeconds = 5.0
    """Pool entries are trusted this long after the last sweep that confirmed them; when no sweep succeeds for
    this long (master down), every pool entry is dropped. At most ``lease_ttl_s``, more than ``interval_s``."""
    request_timeout_s: PositiveSeconds = 2.0
    """Limit of one call to the master during a sweep."""
    decision_check_budget_s: NonNegativeSeconds = 0.0
    """Per routing decision whose chosen worker's prediction includes pool blocks confirmed by no sweep since
    ``interval_s``: ask the master about them (``/batch_query_keys``) and wait at most this long (the decision
    goes ahead unchanged past it); blocks found gone are dropped and the request routed again. 0: off."""
    max_keys_per_check: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    """Most pool blocks one decision check asks about (the first ones of the run, where a miss costs most)."""
    pieces_per_block: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    """Pool objects one block is stored as: kvgate workers put one (every layer group in one chunk: the block's
    single object, or a span holding it, any one of them enough); vLLM's connector puts one per TP rank and PP
    stage, and a block is loadable only while all of them are there."""
    blocks_per_span: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    """The span length of the pool's kvgate workers (their ``kv-cache.pool.blocks-per-span``): a sweep counts the
    span keys of another length in the listing (``num_span_length_mismatches``) and logs each other length once,
    since a worker of another length stores spans the others never find (each worker refuses to attach to a pool
    whose layout marker records another length, ``workers.kv.pool_layout``; this sees a pool mixed anyway, e.g.
    after the marker's holder left). ``None``: not checked. Either way the watcher reads every span key right."""
    max_entries_per_slice: Annotated[int, msgspec.Meta(ge=1)] = 20_000
    """Index holdings compared per event-loop slice of a sweep (the loop runs requests between slices)."""

    def __post_init__(self) -> None:
        if not self.admin_url.startswith(("http://", "https://")):
            raise ValueError(f"admin_url must be an http(s) URL, not {self.admin_url!r}")
        if self.entry_ttl_s > self.lease_ttl_s:
            raise ValueError(f"entry_ttl_s ({self.entry_ttl_s}) may not be longer than the pool's lease_ttl_s "
                             f"({self.lease_ttl_s})")  # fmt: skip
        if self.interval_s >= self.entry_ttl_s:
            raise ValueError(f"interval_s ({self.interval_s}) must be shorter than entry_ttl_s ({self.entry_ttl_s})")
