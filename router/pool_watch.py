"""The pool watcher: what a Mooncake master evicted or lost, taken out of the prefix index.

A ``mooncake_master`` evicts objects on its own (LRU past its high watermark) and tells no client; a restarted
master holds nothing; vLLM's Mooncake store connector publishes every pool write (``BlockStored``, applied as
``MOONCAKE`` by ``router.pool_media``) and never a removal. Left alone, the index would keep crediting pool blocks
no worker can load. The watcher reads the master's HTTP admin port (``--metrics_port``; handlers in Mooncake's
``mooncake-store/src/master_metric_manager.cpp`` and ``http_metadata_server``: ``GET /metrics``,
``GET /get_all_keys`` one key per line, ``GET /batch_query_keys?keys=k1,k2`` JSON ``{"data": {k: {"ok": ...}}}``)
and keeps the index's pool entries to what the master holds. The master percent-decodes the ``keys`` value (``+``
as a space too) and then splits it at commas, so a decision check sends each key percent-encoded (a vLLM key
holds the model name: ``/``, ``+``, ``%``, ``&``, ``#`` would be misread raw) and never asks about a key holding
a comma (no encoding survives the split; the sweeps still see it)::

    every interval_s (a sweep)                       per decision (decision_check_budget_s > 0)
      holdings = index.pool_holdings()                 the chosen worker's pool run (first max_keys_per_check)
      GET /metrics        -> counters (restart?)       GET /batch_query_keys?keys=... within the budget
      GET /get_all_keys   -> {(group, hash): pieces}   gone -> BlockRemoved(MOONCAKE) for their holders,
      held but absent     -> BlockRemoved(MOONCAKE)            and the request is routed again (once)
                             for the worker holding it
      counters went back  -> master restarted (counted): every entry from before is absent, so dropped
      no sweep for entry_ttl_s -> clear every pool entry (TTL; at most the pool's lease)

Keys name a block by its full SHA-256 digest (64 hex digits at the end of the key): kvgate workers
``kvgate/v1/<hex>`` (group 0) and ``kvgate/v1/ckpt/<group>/<hex>``; vLLM
``<model>@tp_rank:T@pcp0@dcp0@pp_rank:P@group:G@<hex>`` (``mooncake/store/worker.py``). Both engines publish the
last 8 digest bytes, big-endian, as the event's block hash (``events.types.fold_engine_hash``), so the key's last
16 hex digits are the index's engine hash. A kvgate span object (several blocks of a chain in one object,
``common.pool_keys``) is ``kvgate/v1/span/<16 hex digits per member but the last>/<hex of the last>``: its
key lists every member's engine hash, so the listing alone says which blocks it holds (``pool_key_blocks``), and
the events stay per block. A block is present while ``pieces_per_block`` of the objects holding it are (vLLM: one
per TP rank and PP stage; kvgate: 1, its single object or any span holding it). The workers' layout marker
(``kvgate/v1/layout``) names no block; with ``blocks_per_span`` set, span keys of another length are counted
(``num_span_length_mismatches``) and each other length logged once. Other keys are ignored
(``num_foreign_keys``).

Costs: a sweep is one listing of every key plus one pass over the index's pool holdings, in slices of
``max_entries_per_slice`` between which the event loop serves requests; ``last_sweep_s`` and the
``kvgate_pool_watch_*`` metrics give its time. A decision check is one HTTP round trip, bounded by its budget
(``last_check_s``). A listing fetched while a worker stores may miss a key stored during the fetch: only the
holdings taken before the listing was asked for are compared with it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from urllib.parse import quote

import aiohttp
import msgspec
import yarl

from common.pool_keys import LAYOUT_KEY, SPAN_PREFIX, member_engine_hashes
from events.types import BlockRemoved, EngineBlockHash, EventBatch, Medium
from router.index import PrefixIndex
from router.index.errors import UnknownWorkerError
from router.index.query import PoolHolding
from router.pool_watch_config import PoolWatchConfig

__all__ = ["PoolWatcher", "parse_counters", "parse_pool_key", "pool_key_blocks"]

logger = logging.getLogger(__name__)

MAX_GROUP_DIGITS = 9
"""A key's group index has at most this many digits (more is no key of ours)."""

_PoolKey = tuple[int, int]
"""(group_idx, engine hash) a pool key names."""


def parse_pool_key(key: str) -> _PoolKey | None:
    """``(group_idx, engine_hash)`` of a kvgate or vLLM pool key (module docstring), or ``None`` for another key."""
    digest = key[-64:]
    if len(digest) != 64 or not (digest.isascii() and digest.isalnum()):  # no sign, space or "_" reaches int()
        return None
    try:
        value = int(digest, 16)
    except ValueError:
        return None
    head = key[:-64]
    group = 0
    if head == "kvgate/v1/":
        pass
    elif head.startswith(SPAN_PREFIX):
        return None  # several blocks: pool_key_blocks
    elif head.startswith("kvgate/v1/ckpt/"):
        num = head[len("kvgate/v1/ckpt/") : -1]
        if not (num.isascii() and num.isdigit()) or not head.endswith("/") or len(num) > MAX_GROUP_DIGITS:
            return None
        group = int(num)
    elif head.endswith("@") and not head.startswith("kvgate/"):
        at = head.find("@group:")
        if at >= 0:
            num = head[at + 7 : head.index("@", at + 1)]
            if not (num.isascii() and num.isdigit()) or len(num) > MAX_GROUP_DIGITS:
                return None
            group = int(num)
    else:
        return None
    return group, value & 0xFFFF_FFFF_FFFF_FFFF


def pool_key_blocks(key: str) -> tuple[_PoolKey, ...] | None:
    """Every ``(group_idx, engine_hash)`` an object's key names: a kvgate span key's members in chain order, else
    ``parse_pool_key``'s one block; ``None`` for another key."""
    if key.startswith(SPAN_PREFIX):
        members = member_engine_hashes(key)
        return None if members is None else tuple((0, h) for h in members)
    parsed = parse_pool_key(key)
    return None if parsed is None else (parsed,)


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> ``{name: value}`` for unlabelled samples (the master's are)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or "{" in line:
            continue
        name, _, value = line.partition(" ")
        with suppress(ValueError):
            number = float(value.split(" ", 1)[0])
            if math.isfinite(number):  # NaN / Inf: no count (int() of one raises)
                out[name] = number
    return out


def _went_back(before: Mapping[str, float], now: Mapping[str, float]) -> bool:
    """Whether any of the master's cumulative counters (``*_total``) is lower than before: they only grow while
    it runs, so one that went back means a new master process (which holds none of the old objects)."""
    return any(now.get(k, 0.0) < v for k, v in before.items() if k.endswith("_total"))


class _Query(msgspec.Struct):
    ok: bool = False


class _BatchQuery(msgspec.Struct):
    success: bool = False
    data: dict[str, _Query] = {}


_decode_batch_query = msgspec.json.Decoder(_BatchQuery).decode


class PoolWatcher:
    """Keeps the indexes' ``MOONCAKE`` entries to what one master holds (module docstring).

    Args:
        config: the ``pool_watch`` section.
        indexes: model name -> its prefix index (each with its pool members).
        clock: monotonic clock in seconds.

    Attributes:
        is_master_up: whether the last sweep reached the master.
        master_evicted_key_count: the master's ``master_evicted_key_count`` at the last sweep.
        master_key_count: keys the master listed at the last sweep.
        last_sweep_s: duration of the last successful sweep (listing, comparison, drops), seconds.
        last_check_s: duration of the last decision check, seconds.
    """

    def __init__(
        self, config: PoolWatchConfig, indexes: Mapping[str, PrefixIndex], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.indexes = indexes
        self.clock = clock
        self._base = config.admin_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._counters: dict[str, float] | None = None
        self.confirmed_at_s: float | None = None
        """When the last successful sweep asked for the listing (entries confirmed then)."""
        self._is_cleared = False
        self._known: dict[str, dict[int, tuple[list[str], list[PoolHolding]]]] = {}
        """Model -> our block hash -> (the keys of the objects holding it, its holdings): group 0 blocks present
        at the last sweep, what a decision check asks about and drops."""
        self.is_master_up = False
        self.master_evicted_key_count = 0
        self.master_key_count = 0
        self.last_sweep_s = 0.0
        self.last_check_s = 0.0
        self.num_sweeps = 0
        self.num_failed_sweeps = 0
        self.num_entries_dropped = 0
        self.num_master_restarts = 0
        self.num_ttl_clears = 0
        self.num_foreign_keys = 0
        self.num_span_length_mismatches = 0
        """Span keys of another length than ``blocks_per_span`` seen by the sweeps (each sweep counts its own)."""
        self._span_lengths_logged: set[int] = set()
        self.num_checks = 0
        self.num_checks_unanswered = 0
        self.num_check_drops = 0
        self.num_confirms = 0
        self.num_confirm_drops = 0

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Sweep every ``interval_s`` until cancelled (a background loop of the gateway)."""
        await self.open()
        try:
            while True:
                await self.sweep()
                await asyncio.sleep(self.config.interval_s)
        finally:
            await self.close()

    async def open(self) -> None:
        """Open the HTTP session to the master (``run`` does; tests call ``sweep`` and ``check`` between)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s))

    async def close(self) -> None:
        """Close the HTTP session."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _get(self, path: str) -> str:
        """GET ``path`` (already percent-encoded: sent as it is)."""
        session = self._session
        if session is None:
            raise RuntimeError("the pool watcher is not running")
        async with session.get(yarl.URL(self._base + path, encoded=True)) as resp:
            resp.raise_for_status()
            return (await resp.read()).decode("utf-8", "replace")  # a key with bytes not UTF-8 is a foreign key

    async def sweep(self) -> bool:
        """One sweep (module docstring); whether the master answered. Never raises for a master that is down."""
        started_s = self.clock()
        t0 = time.perf_counter()
        holdings = {name: index.pool_holdings(Medium.MOONCAKE) for name, index in self.indexes.items()}
        try:
            counters = parse_counters(await self._get("/metrics"))
            listing = await self._get("/get_all_keys")
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
            self.num_failed_sweeps += 1
            if self.is_master_up:
                logger.warning("pool watch: master at %s unreachable: %r", self._base, exc)
            self.is_master_up = False
            confirmed = self.confirmed_at_s
            if confirmed is None or started_s - confirmed >= self.config.entry_ttl_s:
                if not self._is_cleared:
                    self.num_ttl_clears += 1
                    logger.warning("pool watch: no sweep confirmed the pool for entry_ttl_s (%.1f s): every pool "
                                   "entry dropped until the master answers", self.config.entry_ttl_s)  # fmt: skip
                self.clear_pool_entries()  # again each time: nothing the pool holds can be trusted
            return False
        self.is_master_up = True
        if self._counters is not None and _went_back(self._counters, counters):
            self.num_master_restarts += 1  # it holds nothing from before: the comparison below drops all of that
            logger.warning("pool watch: master at %s restarted (its request counters went back): the pool entries "
                           "it no longer holds are dropped", self._base)  # fmt: skip
        self._counters = counters
        self.master_evicted_key_count = int(counters.get("master_evicted_key_count", 0))
        present: Counter[_PoolKey] = Counter()
        key_of: dict[_PoolKey, list[str]] = {}
        num_keys = 0
        span_len = self.config.blocks_per_span
        for key in listing.splitlines():
            if not key:
                continue
            num_keys += 1
            blocks = pool_key_blocks(key)
            if blocks is None:
                if key != LAYOUT_KEY:  # the workers' layout marker names no block
                    self.num_foreign_keys += 1
                continue
            if len(blocks) > 1 and span_len is not None and len(blocks) != span_len:
                self._span_length_mismatch(key, len(blocks))
            for parsed in blocks:
                present[parsed] += 1
                key_of.setdefault(parsed, []).append(key)
        self.master_key_count = num_keys
        need = self.config.pieces_per_block
        for name, held in holdings.items():
            known: dict[int, tuple[list[str], list[PoolHolding]]] = {}
            gone: list[PoolHolding] = []
            for start in range(0, len(held), self.config.max_entries_per_slice):
                for holding in held[start : start + self.config.max_entries_per_slice]:
                    _, _, group, engine_hash, block_hash = holding
                    if present[(group, engine_hash)] < need:
                        gone.append(holding)
                    elif group == 0:
                        entry = known.get(block_hash)
                        if entry is None:
                            known[block_hash] = (key_of[(0, engine_hash)], [holding])
                        else:
                            entry[1].append(holding)
                await asyncio.sleep(0)  # a slice: requests run between
            self._drop(self.indexes[name], gone)
            self._known[name] = known
        self.confirmed_at_s = started_s
        self._is_cleared = False
        self.num_sweeps += 1
        self.last_sweep_s = time.perf_counter() - t0
        return True

    def _span_length_mismatch(self, key: str, num_members: int) -> None:
        self.num_span_length_mismatches += 1
        if num_members not in self._span_lengths_logged:
            self._span_lengths_logged.add(num_members)
            logger.warning("pool watch: the master at %s holds spans of %d blocks (%s), the pool's workers use %d "
                           "(pool_watch.blocks_per_span): a worker of another span length stores spans the others "
                           "never look up", self._base, num_members, key[:40] + "...",
                           self.config.blocks_per_span)  # fmt: skip

    # ------------------------------------------------------------------ drops

    def _drop(self, index: PrefixIndex, gone: Sequence[PoolHolding]) -> None:
        """``BlockRemoved`` (MOONCAKE) for each holding, applied as its worker's."""
        by_engine: dict[tuple[str, int, int], list[EngineBlockHash]] = {}
        for worker_id, dp_rank, group, engine_hash, _ in gone:
            by_engine.setdefault((worker_id, dp_rank, group), []).append(EngineBlockHash(engine_hash))
        now = time.time()
        for (worker_id, dp_rank, group), hashes in by_engine.items():
            removed = BlockRemoved(block_hashes=tuple(hashes), medium=Medium.MOONCAKE, group_idx=group)
            index.apply(EventBatch(worker_id, dp_rank, 0, now, (removed,)))
        self.num_entries_dropped += len(gone)

    def clear_pool_entries(self) -> None:
        """Drop every pool entry of every index (master restarted, or unreachable past ``entry_ttl_s``)."""
        for index in self.indexes.values():
            for worker_id in index.state.pool_members.get(Medium.MOONCAKE, frozenset()):
                with suppress(UnknownWorkerError):
                    index.clear_worker(worker_id, Medium.MOONCAKE)
        self._known.clear()
        self._is_cleared = True

    # ------------------------------------------------------------------ decision checks

    async def check(self, model: str, block_hashes: Sequence[int]) -> int:
        """Ask the master about a decision's pool run (our block hashes, root-most first) within
        ``decision_check_budget_s``; drop the blocks found gone. Returns how many index blocks went (0 also when
        the answer came too late, the watcher is not running, or no key of the run is known yet)."""
        return await self._query(model, block_hashes, self.config.decision_check_budget_s)

    async def confirm_gone(self, model: str, block_hashes: Sequence[int]) -> int:
        """After an answer: ask the master about the pool blocks a worker did not serve though the index priced
        them (the mismatch's blocks), within ``request_timeout_s``, and drop those gone, as ``check`` does. The
        master evicts without telling anyone, and a worker announces only the losses of objects it stored or
        read, so an eviction of another member's object between the last sweep and the worker's lookup reaches
        no journal; dropped here, it is journaled (``IndexState.pool_evicted``) and the honesty check reads it as
        a forecast miss, not as a wrong index. A pool block is announced only once its put landed, so a block the
        master no longer holds was evicted or lost. Counted in ``num_confirms`` / ``num_confirm_drops``."""
        self.num_confirms += 1
        dropped = await self._query(model, block_hashes, self.config.request_timeout_s, is_check=False)
        self.num_confirm_drops += dropped
        return dropped

    async def _query(self, model: str, block_hashes: Sequence[int], budget: float, is_check: bool = True) -> int:
        known = self._known.get(model)
        if budget <= 0 or not known or self._session is None:
            return 0
        wanted = [
            (h, known[h][0])
            for h in block_hashes[: self.config.max_keys_per_check]
            if h in known and not any("," in k for k in known[h][0])  # unaskable: left to the sweeps
        ]
        if not wanted:
            return 0
        self.num_checks += is_check
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(budget):
                keys = ",".join(quote(k, safe="") for k in dict.fromkeys(k for _, ks in wanted for k in ks))
                answer = _decode_batch_query(await self._get(f"/batch_query_keys?keys={keys}"))
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, RuntimeError):
            self.num_checks_unanswered += is_check
            return 0
        finally:
            if is_check:
                self.last_check_s = time.perf_counter() - t0
        data = answer.data
        need = self.config.pieces_per_block
        gone = {h for h, ks in wanted if sum(k in data and data[k].ok for k in ks) < need}
        if not gone:
            return 0
        drops = [holding for h in gone for holding in known.pop(h)[1]]
        self._drop(self.indexes[model], drops)
        self.num_check_drops += len(gone) if is_check else 0
        return len(gone)
