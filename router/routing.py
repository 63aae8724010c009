"""One routing decision: request view -> snapshot -> policy (-> session store) -> an ordered plan of workers.

``Router.route`` is the request path's decision step (DESIGN.md §2):

1. the candidates are the workers serving the request's model, in registration order;
2. one ``index.match(block_hashes)`` gives each worker's GPU / CPU / pool depth in blocks; each is capped at
   the full blocks of the worker's own block size before the last prompt token (vLLM always computes the last
   prompt token): ``(num_prompt_tokens - 1) // worker_block_size * worker_block_size`` tokens, then turned into
   tokens, so the predicted cached tokens equal what the worker reports;
3. a forced worker (``X-SMG-Target-Worker`` / ``x-kvgate-worker``) bypasses the policy;
4. ``session_sticky`` with a session key: ``SessionOwnership.claim`` (``router.ownership``: inner best ->
   ``store.claim_or_touch(key, best)`` -> pure ``resolve`` -> ``store.move`` compare-and-set only when ownership
   changes; on a lost race, the owner the store returns wins); otherwise ``policy.select(view, snapshot)``;
5. the chosen worker gets the request's blocks in the index (through its ``IndexTicket``), root-first in slices,
   one per turn of the event loop (``router.sliced_insert``): approximate-mode workers with the index's TTL;
   workers that publish events (one dp rank) as *pending* entries (``ModelConfig.enable_pending_blocks``,
   ``pending_blocks_ttl_s``) that its ``BlockStored`` events confirm. Pending rule: the prompt's full blocks in
   the worker's block size (engines cache full blocks only). A request routed behind it is scheduled FCFS and
   admitted no earlier than the step that schedules its last prefill chunk, so it finds them: vLLM caches
   blocks as it allocates them in ``schedule`` (chunk by chunk, before admitting the next waiting request);
   the sim worker caches them in ``update`` after the step that computed them, the same except for two
   requests admitted in one step (the later one misses that step's chunk of the earlier one);
   A chain already held by the chosen worker and inserted for it less than ``REFRESH_FRACTION`` of its TTL ago
   is not re-inserted (a repeated prompt would otherwise re-touch every block and queue one expiry record per
   request): its entries may then expire up to that fraction of the TTL before a per-request refresh would have;
6. the decision (every candidate's score, and its inputs, from which ``/admin/decisions`` shows each candidate's
   cost terms) goes to a bounded ring; for a request with a session key that the policy placed (not forced), the
   chosen worker's recent assignments count one more (``RecentAssignments``: what the snapshot of the next
   request with a session key carries, the policies' last tie-break before configuration order, so sessions that
   tie on an idle fleet spread; requests without a session keep configuration order);
7. after the answer, ``IndexTicket.settle`` (called by ``RequestFlight.finish``): when the chosen worker did not
   serve the request (it refused it, failed before the first byte, every attempt failed, or the client left before
   the first byte), the pending entries of step 5 are withdrawn, and the worker that served it after a retry gets
   them, so a refused or rerouted request never inflates a prediction.

``route`` is the one entry for every policy; it does not suspend unless the session store is awaited.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import Protocol

import msgspec

from policies import SessionStickyPolicy, derive_session_key, find_calibrator
from policies.base import Decision, Policy, RequestView, Snapshot, WorkerState
from policies.config import KeySource, PolicyConfig
from policies.cost_model import TTFTCalibrator
from router.config import ModelConfig
from router.decisions import DecisionRecord, DecisionRing, RecentAssignments
from router.errors import InvalidFieldError, NoWorkerError
from router.fleet import CircuitState, Fleet, WorkerRuntime
from router.index.config import IndexConfig
from router.index.result import MatchResult
from router.ownership import SessionOwnership
from router.pool_watch import PoolWatcher
from router.request_view import ParsedRequest, PromptView
from router.sessions.base import SessionStore
from router.sliced_insert import ApproxIndex, SlicedInsert

logger = logging.getLogger(__name__)

FORCE_WORKER_HEADERS = ("x-kvgate-worker", "x-smg-target-worker")
REFRESH_FRACTION = 0.125
"""A chain inserted for a worker is re-inserted (TTL refreshed) only this fraction of its TTL after the last time."""
MAX_RECENT_INSERTS = 8192
"""Bound on the memo of recent chain insertions (cleared when full)."""
DEFAULT_KEY_SOURCES: tuple[KeySource, ...] = ("x-session-id", "x-smg-routing-key", "user")
_CLOSED = CircuitState.CLOSED
_NO_LIMIT = 1 << 62

MAX_SCORED_WORKERS = 64
"""Past this many candidates a decision scores only ``scored_workers``: the prefix holders and a load sample."""
LOAD_SAMPLE = 8
"""Workers sampled for load in a large fleet beside the prefix holders (SGLang's gateway samples 8)."""


def scored_workers(
    candidates: Sequence[WorkerRuntime], workers_by_id: Mapping[str, WorkerRuntime], match: MatchResult | None,
    turn: int,
) -> list[WorkerRuntime]:
    """The workers one decision scores in a large fleet, O(holders + ``LOAD_SAMPLE``) rather than O(candidates).

    The ``MAX_SCORED_WORKERS`` deepest workers that hold part of the prompt's prefix (the index match's holders,
    deepest first; the index is the model's, so they serve it), then ``LOAD_SAMPLE`` others from a window of
    ``candidates`` that moves by ``LOAD_SAMPLE`` each decision (``turn``), so every idle worker is offered in turn.
    A session's owner is scored when it is among those holders, as it is while its cache lives. A prompt whose
    first block the whole fleet holds (a shared system prompt) costs the same as one two workers hold: the match
    resolves only the holders read here (``router.index.result.HolderMatches``).

    Returns:
        Holders in match order, then the sample in candidate order.
    """
    out: list[WorkerRuntime] = []
    seen: set[str] = set()
    if match is not None:
        for worker_id in islice(match.workers, MAX_SCORED_WORKERS):
            worker = workers_by_id.get(worker_id)
            if worker is not None:
                out.append(worker)
                seen.add(worker_id)
    n = len(candidates)
    start = (turn * LOAD_SAMPLE) % n
    added = 0
    for i in range(min(n, LOAD_SAMPLE + len(seen))):
        worker = candidates[(start + i) % n]
        if worker.worker_id not in seen:
            out.append(worker)
            seen.add(worker.worker_id)
            added += 1
            if added == LOAD_SAMPLE:
                break
    return out
"""In-flight limit standing for "none" (``max_inflight`` 0)."""


class IndexLike(ApproxIndex, Protocol):
    """The part of ``router.index.PrefixIndex`` the request path uses (with what ``SlicedInsert`` uses)."""

    @property
    def config(self) -> IndexConfig: ...

    def match(self, block_hashes: Sequence[int]) -> MatchResult: ...

    @property
    def is_hybrid(self) -> bool: ...

    @property
    def journal_seq(self) -> int: ...

    def open_journal_window(self) -> int: ...

    def close_journal_window(self, seq: int) -> None: ...

    def evicted_since(self, worker_id: str, block_hash: int, seq: int) -> bool: ...

    def any_evicted_since(self, worker_id: str, block_hashes: Sequence[int], seq: int) -> bool: ...

    def confirmed_since(self, worker_id: str, block_hash: int, seq: int) -> bool: ...

    def miss_cause(self, worker_id: str, block_hashes: Sequence[int], first: int, end: int, seq: int, *,
                   pending_end: int | None = None) -> str | None: ...


class PolicyHolder:
    """The live policy and its config; the admin API swaps both at once (no restart)."""

    def __init__(self, config: PolicyConfig, policy: Policy) -> None:
        self.config = config
        self.policy = policy
        self.key_sources: tuple[KeySource, ...] = DEFAULT_KEY_SOURCES
        self.set(config, policy)

    def set(self, config: PolicyConfig, policy: Policy) -> None:
        """Install a new policy (already validated and built)."""
        self.config = config
        self.policy = policy
        self.sticky = policy if isinstance(policy, SessionStickyPolicy) else None
        self.calibrator = find_calibrator(policy)
        self.key_sources = self.sticky.config.key_sources if self.sticky is not None else DEFAULT_KEY_SOURCES


class IndexTicket:
    """One request's only handle on its model's index: the match and the pending (or approximate) insertion made
    when it is routed, the withdrawal or transfer when it is settled (module docstring, steps 2, 5 and 7).

    Attributes:
        pending: the chosen worker's entries this request inserted, or ``None`` (none, or already withdrawn).
    """

    __slots__ = ("_index", "_model", "_view", "_memo", "pending", "_journal_seq", "_is_window_open", "_gpu_depth")

    def __init__(self, index: IndexLike | None, model: ModelConfig, view: PromptView,
                 memo: dict[tuple[str, int, int], float]) -> None:
        self._index = index if view.block_hashes else None
        self._model = model
        self._view = view
        self._memo = memo
        self.pending: SlicedInsert | None = None
        self._journal_seq = -1  # the journal stamp at ``match``, held open until ``settle`` or ``__del__``
        self._is_window_open = False
        self._gpu_depth: tuple[str, int] | None = None  # the chosen worker, its blocks on GPU at ``insert_for``

    def __del__(self) -> None:  # the request is answered or dropped (``PrefixIndex.open_journal_window``)
        self.close_window()

    def close_window(self) -> None:
        """Release the stamp of ``match``, once (a retried request's plan outlives it in a traceback; ``settle``)."""
        if self._is_window_open and self._index is not None:
            self._is_window_open = False
            self._index.close_journal_window(self._journal_seq)

    def match(self) -> MatchResult | None:
        """Every worker's cached depth of the prompt's blocks, or ``None`` (no index or no block).

        A hybrid index (several cache groups) is matched on the blocks the engine may serve at most: its prefix is
        the longest every group serves within that cap (a recurrent group needs a checkpoint exactly at its end), so
        the cap is applied before the match, not after it (module docstring, step 2)."""
        index = self._index
        if index is None:
            return None
        self.close_window()  # matched again: the newer stamp replaces the older
        self._journal_seq = index.open_journal_window()
        self._is_window_open = True
        view = self._view
        if index.is_hybrid:
            return index.match(view.block_hashes[: view.num_cacheable_blocks])
        return index.match(view.block_hashes)

    def missed_blocks(self, predicted_tokens: int, reported_tokens: int) -> tuple[str, Sequence[int]]:
        """The model and the block hashes a worker did not serve from cache though predicted."""
        bs, hashes = self._view.block_size, self._view.block_hashes
        return self._model.name, hashes[reported_tokens // bs : predicted_tokens // bs]

    def mismatch_cause(self, worker_id: str, predicted_tokens: int, reported_tokens: int) -> str:
        """Why ``worker_id`` reported ``reported_tokens`` cached where ``predicted_tokens`` were predicted
        (``router.metrics.MISMATCH_CAUSES``): ``"late"`` when it held more; for the predicted blocks it did not
        serve (``missed_blocks``), ``"evicted"`` when it reported evicting one after the decision, ``"pending"``
        when the first was then a pending entry a store confirmed since (a burst before the events); ``"index"``
        otherwise: it held fewer blocks than the index said, and nothing the worker reported explains it (a store of
        a block the decision credited below GPU confirms this request's own entry, ``insert_for``: no ``"pending"``)."""
        if reported_tokens > predicted_tokens:
            return "late"
        index = self._index
        if index is not None and index.journal_seq != self._journal_seq:  # else nothing was evicted or confirmed since
            bs, hashes, depth = self._view.block_size, self._view.block_hashes, self._gpu_depth
            end = depth[1] if depth and depth[0] == worker_id else None
            cause = index.miss_cause(worker_id, hashes, reported_tokens // bs, min(predicted_tokens // bs, len(hashes)),
                                     self._journal_seq, pending_end=end)
            if cause is not None:
                return cause
        return "index"

    def insert_for(self, worker: WorkerRuntime, match: MatchResult | None, now_s: float) -> None:
        """The chosen worker's entries for the request (module doc, step 5), kept as ``pending``."""
        if self._index is not None:
            held = match.workers.get(worker.worker_id) if match is not None else None
            self._gpu_depth = (worker.worker_id, held.num_gpu_blocks if held is not None else 0)
            self.pending = self._insert_for(self._index, worker, match, now_s)

    def _insert(
        self, index: IndexLike, worker: WorkerRuntime, block_hashes: Sequence[int], match: MatchResult | None,
        now_s: float, ttl_s: float | None,
    ) -> SlicedInsert | None:
        """``index.insert_approximate`` unless the worker holds the chain and it was inserted recently (module doc),
        root-first in slices (``router.sliced_insert``); returns the insertion (``None`` when skipped)."""
        num_blocks = len(block_hashes)
        if not num_blocks:
            return None
        memo = self._memo
        key = (worker.worker_id, block_hashes[-1], num_blocks)
        last_s = memo.get(key)
        if last_s is not None and match is not None:
            held = match.workers.get(worker.worker_id)
            window_s = (ttl_s if ttl_s is not None else index.config.approx_ttl_s) * REFRESH_FRACTION
            if held is not None and held.num_gpu_blocks >= num_blocks and 0.0 <= now_s - last_s < window_s:
                return None
        inserted = SlicedInsert(index, worker.worker_id, block_hashes, now_s, ttl_s)
        if len(memo) >= MAX_RECENT_INSERTS:
            memo.clear()
        memo[key] = now_s
        return inserted

    def _insert_for(
        self, index: IndexLike, worker: WorkerRuntime, match: MatchResult | None, now_s: float,
    ) -> SlicedInsert | None:
        """The blocks a request sent to ``worker`` makes it hold (module doc, step 5), inserted; ``None`` when the
        worker needs none (it publishes events and pending entries are off, or it has several dp ranks)."""
        view = self._view
        model = self._model
        cap = model.max_routed_blocks  # a huge prompt's first blocks only: bounded time on the loop
        if worker.is_approximate:
            hashes = view.block_hashes
            return self._insert(index, worker, hashes if len(hashes) <= cap else hashes[:cap], match, now_s, None)
        if model.enable_pending_blocks and worker.config.dp_ranks == 1:
            num_full = view.num_tokens // worker.block_size * worker.block_size // view.block_size
            return self._insert(index, worker, view.block_hashes[:min(num_full, cap)], match, now_s,
                                model.pending_blocks_ttl_s)
        return None

    def settle(self, chosen: WorkerRuntime, served_by: WorkerRuntime | None, is_ok: bool, now_s: float,
               *, keep_window: bool = False) -> None:
        """After the answer and its mismatch check (the stamp of ``match`` released, unless ``keep_window``): unless
        ``chosen`` served it (``is_ok``: status < 400), its pending entries are withdrawn, or given to a retry's."""
        if not keep_window:
            self.close_window()
        index = self._index
        if index is None or (served_by is chosen and is_ok):
            return
        pending = self.pending
        if pending is not None:
            pending.withdraw()
            self.pending = None
            hashes = pending.block_hashes
            self._memo.pop((chosen.worker_id, hashes[-1], len(hashes)), None)
        if is_ok and served_by is not None and served_by is not chosen:
            self._insert_for(index, served_by, None, now_s)


class RoutePlan(msgspec.Struct, frozen=True, gc=False):
    """Where one request goes: the routing decision, read only.

    Attributes:
        decision: the policy's decision.
        chosen: the chosen worker (tried first; ``fallbacks`` gives the rest of the ranking).
        predicted_cached_tokens: per worker id, cached prompt tokens predicted (honesty check); its keys are the
            candidates.
        num_prompt_tokens: prompt tokens.
        session_key: the session key, or ``None``.
        speed_factor_used: the chosen worker's calibration factor at decision time (1.0 without one).
        decision_s: time the decision took, seconds.
        workers_by_id: the fleet's workers by id (``fallbacks`` resolves the ranking in it).
        ticket: the request's handle on its index (its pending entries, settled after the answer).
        calibrator: the TTFT calibrator of the policy that decided (observed TTFTs go to it, not to a policy
            installed since), or ``None``.
        is_session_sticky: the policy that decided keeps sessions on their owner (a retry served elsewhere moves
            the session there).
    """

    decision: Decision
    chosen: WorkerRuntime
    predicted_cached_tokens: dict[str, int]
    num_prompt_tokens: int
    session_key: str | None
    speed_factor_used: float = 1.0
    decision_s: float = 0.0
    workers_by_id: Mapping[str, WorkerRuntime] = msgspec.field(default_factory=dict)
    ticket: IndexTicket | None = None
    calibrator: TTFTCalibrator | None = None
    is_session_sticky: bool = False

    def fallbacks(self, max_workers: int) -> list[WorkerRuntime]:
        """Up to ``max_workers`` workers to try after the chosen one: the rest of the decision's ranking, best
        first, that were candidates and are still registered (resolved when a retry needs them)."""
        chosen_id = self.chosen.worker_id
        workers = self.workers_by_id
        predicted = self.predicted_cached_tokens
        out = [workers[w] for w in self.decision.ranking if w != chosen_id and w in predicted and w in workers]
        return out[:max_workers]


class Router:
    """Turns a parsed request and its prompt view into a ``RoutePlan``."""

    def __init__(
        self, fleet: Fleet, indexes: Mapping[str, IndexLike], sessions: SessionStore, holder: PolicyHolder,
        *, num_recent_decisions: int = 256, default_max_tokens: int = 256,
        clock: Callable[[], float] = time.monotonic, pool_watcher: PoolWatcher | None = None,
    ) -> None:
        self._fleet = fleet
        self._indexes = indexes
        self.pool_watcher = pool_watcher  # also asked by the honesty check (``RequestLifecycle.finish``)
        self.ownership = SessionOwnership(sessions)
        self.holder = holder
        self._clock = clock
        self.recent = DecisionRing(num_recent_decisions)
        self._num_decisions = 0
        """Decisions in fleets over ``MAX_SCORED_WORKERS`` (moves the load sample's window)."""
        self._inserted_at_s: dict[tuple[str, int, int], float] = {}
        self.assignments = RecentAssignments()

    @property
    def fleet(self) -> Fleet:
        """The fleet routed over."""
        return self._fleet

    def forget_worker(self, worker_id: str) -> None:
        """Drop a removed worker's entries of the recent-insertion memo and the sessions ``session_sticky`` counted
        as resident on it (its decision records age out)."""
        memo = self._inserted_at_s
        for key in [k for k in memo if k[0] == worker_id]:
            del memo[key]
        sticky = self.holder.sticky
        if sticky is not None:
            sticky.forget_worker(worker_id)

    def ticket(self, model: ModelConfig, view: PromptView) -> IndexTicket:
        """A request's handle on its model's index, for a route decided outside ``route`` (``router.pd``)."""
        return IndexTicket(self._indexes.get(model.name), model, view, self._inserted_at_s)

    def session_key(self, headers: Mapping[str, str], parsed: ParsedRequest, view: PromptView) -> str | None:
        """The request's session key from the configured sources (``policies.derive_session_key``)."""
        return derive_session_key(self.holder.key_sources, headers, parsed.user, view.opening_hash)

    @staticmethod
    def states(
        candidates: Sequence[WorkerRuntime], view: PromptView, now_s: float, max_inflight: int,
        match: MatchResult | None, recent: Mapping[str, int] | None = None,
        resident: Mapping[str, int] | None = None,
    ) -> tuple[tuple[WorkerState, ...], dict[str, int]]:
        """Each candidate's ``WorkerState`` (the policy's view of it) and its predicted cached tokens.

        Cached tokens come from one index match of ``view.block_hashes`` (``None``: nothing matched), capped as the
        module docstring says. Load: requests in flight through this gateway, or the polled count when larger;
        waiting requests and KV usage as polled (0 without a poll). Healthy: its health checks pass, it has fewer
        than ``max_inflight`` requests in flight (0: no limit), and its circuit lets a request through at
        ``now_s``. ``recent`` gives each worker's recent assignments (``RecentAssignments.counts``; none: 0),
        ``resident`` its live sessions' prompt tokens (``SessionResidents.resident_tokens``; none: 0); the GPU
        capacity in tokens is the polled GPU blocks times the worker's block size (0 before a poll).

        Returns:
            ``(states in candidate order, predicted cached tokens (all tiers) by worker id)``.
        """
        matched = match.workers if match is not None else None
        bs = view.block_size
        cap = (view.num_tokens - 1) // bs  # PromptView.num_cacheable_blocks
        if cap < 0:
            cap = 0
        limit = max_inflight if max_inflight > 0 else _NO_LIMIT
        recent = recent or {}
        resident = resident or {}
        states: list[WorkerState] = []
        predicted: dict[str, int] = {}
        for worker in candidates:
            worker_id = worker.worker_id
            m = matched.get(worker_id) if matched else None
            if m is None:
                gpu_tokens = cpu_tokens = pool_tokens = 0
                predicted[worker_id] = 0
            else:
                gpu = m.num_gpu_blocks
                cpu = gpu + m.num_cpu_blocks
                pool = cpu + m.num_pool_blocks
                worker_cap = cap
                if worker.block_size != bs:  # the engine caps in its own blocks (a multiple of the model's)
                    worker_cap = (view.num_tokens - 1) // worker.block_size * worker.block_size // bs
                if pool > worker_cap:  # capped per tier, from the root: GPU, then CPU, then pool
                    pool = worker_cap
                    if cpu > pool:
                        cpu = pool
                        if gpu > pool:
                            gpu = pool
                gpu_tokens, cpu_tokens, pool_tokens = gpu * bs, (cpu - gpu) * bs, (pool - cpu) * bs
                predicted[worker_id] = pool * bs
            running = worker.num_inflight_requests
            breaker = worker.breaker
            is_healthy = worker.is_healthy and running < limit and (breaker.state is _CLOSED or breaker.allows(now_s))
            load = worker.load
            if load is None:
                states.append(WorkerState(worker_id, is_healthy, worker.is_draining, gpu_tokens, cpu_tokens,
                                          pool_tokens, running, 0, worker.num_pending_prefill_tokens, 0.0,
                                          worker.num_inflight_prompt_tokens, recent.get(worker_id, 0), 0,
                                          resident.get(worker_id, 0), worker.num_pending_prefill_token_pairs,
                                          tuple(worker.pending_prefills.values()), worker.prefill_done_at_s,
                                          now_s / worker.config.time_scale))
            else:
                states.append(WorkerState(
                    worker_id, is_healthy, worker.is_draining, gpu_tokens, cpu_tokens, pool_tokens,
                    max(running, load.num_running_requests), load.num_waiting_requests,
                    worker.num_pending_prefill_tokens, load.kv_usage, worker.num_inflight_prompt_tokens,
                    recent.get(worker_id, 0),
                    (load.num_total_blocks or {}).get("GPU", 0) * worker.block_size, resident.get(worker_id, 0),
                    worker.num_pending_prefill_token_pairs, tuple(worker.pending_prefills.values()),
                    worker.prefill_done_at_s, now_s / worker.config.time_scale,
                ))
        return tuple(states), predicted

    def _inputs(
        self, request_id: str, parsed: ParsedRequest, model: ModelConfig, view: PromptView,
        headers: Mapping[str, str], max_inflight_per_worker: int,
    ) -> tuple[float, float, tuple[WorkerRuntime, ...], IndexTicket, MatchResult | None, dict[str, int], RequestView,
               Snapshot]:
        """``(t0, now_s, candidates, index ticket, match, predicted cached tokens by worker, request view,
        snapshot)``.

        Raises:
            NoWorkerError: no worker serves the model.
        """
        t0 = time.perf_counter()
        now_s = self._clock()
        candidates = self._fleet.candidates(model.name)
        if not candidates:
            raise NoWorkerError(f"no worker serves model {parsed.model!r}", reason="no_workers")
        ticket = IndexTicket(self._indexes.get(model.name), model, view, self._inserted_at_s)
        match = ticket.match()
        if len(candidates) > MAX_SCORED_WORKERS and not any(name in headers for name in FORCE_WORKER_HEADERS):
            self._num_decisions += 1
            candidates = tuple(scored_workers(candidates, self._fleet.workers, match, self._num_decisions))
        if headers or parsed.user is not None or view.opening_hash is not None:
            session_key = derive_session_key(self.holder.key_sources, headers, parsed.user, view.opening_hash)
        else:
            session_key = None  # no source has a value
        sticky = self.holder.sticky
        resident = sticky.residents.resident_tokens(now_s, session_key) if sticky is not None else None
        states, predicted = self.states(candidates, view, now_s, max_inflight_per_worker, match,
                                        self.assignments.counts if session_key is not None else None, resident)
        req = RequestView(request_id, parsed.model, view.num_tokens, parsed.max_tokens or model.default_max_tokens,
                          view.block_size, session_key,
                          sticky.residents.projected_growth_tokens if sticky is not None and session_key else 0)
        return t0, now_s, candidates, ticket, match, predicted, req, Snapshot(states, None, now_s)

    @staticmethod
    def _forced(
        headers: Mapping[str, str], parsed: ParsedRequest, candidates: Sequence[WorkerRuntime], snapshot: Snapshot,
    ) -> Decision | None:
        """The decision for a forced worker (``FORCE_WORKER_HEADERS``), or ``None`` without one.

        A forced worker is still subject to the operator's drain: a draining worker is refused, never sent the
        request. Health and the circuit breaker do not stop it: forcing is how one probes a worker that is
        recovering (a request it cannot take fails as any request to it would, without a retry elsewhere).

        Raises:
            InvalidFieldError: the forced worker does not exist or does not serve the model.
            NoWorkerError: the forced worker is draining (503, reason ``forced_worker_unavailable``).
        """
        forced = None
        for name in FORCE_WORKER_HEADERS:
            forced = headers.get(name)
            if forced is not None:
                break
        if forced is None:
            return None
        if forced not in {w.worker_id for w in candidates}:
            raise InvalidFieldError(f"forced worker {forced!r} does not serve model {parsed.model!r}",
                                    param="x-kvgate-worker")
        state = next(s for s in snapshot.workers if s.worker_id == forced)
        if state.is_draining:
            raise NoWorkerError(f"forced worker {forced!r} cannot take requests now: draining",
                                reason="forced_worker_unavailable")
        return Decision(forced, "forced", {}, state.num_cached_tokens, (forced,))

    async def route(
        self, request_id: str, parsed: ParsedRequest, model: ModelConfig, view: PromptView,
        headers: Mapping[str, str], *, max_inflight_per_worker: int = 0,
    ) -> RoutePlan:
        """Decide where the request goes (every policy; the session store is awaited only under
        ``session_sticky`` with a session key).

        Raises:
            NoWorkerError: no worker serves the model, or none is healthy and undrained (503 with the reason).
            InvalidFieldError: a forced worker that does not exist or does not serve the model.
        """
        holder = self.holder
        sticky = holder.sticky
        for attempt in (0, 1):  # a decision check that finds the chosen pool run gone routes once more
            t0, now_s, candidates, ticket, match, predicted, req, snapshot = self._inputs(
                request_id, parsed, model, view, headers, max_inflight_per_worker)
            session_key = req.session_key
            decision = self._forced(headers, parsed, candidates, snapshot) if headers else None
            recorded: tuple[RequestView, Snapshot] | None = None
            if decision is None:
                if sticky is not None and session_key is not None:
                    recorded = sticky.inner_inputs(req, snapshot)  # the admin's cost terms: what the inner ranked
                    decision = await self.ownership.claim(sticky, session_key, req, snapshot, recorded)
                else:
                    decision = holder.policy.select(req, snapshot)
            chosen = match.get(decision.worker_id) if match is not None and decision.worker_id else None
            if attempt or chosen is None or not chosen.num_pool_blocks or self.pool_watcher is None:
                break
            start = chosen.num_gpu_blocks + chosen.num_cpu_blocks
            run = view.block_hashes[start : start + chosen.num_pool_blocks]
            if not await self.pool_watcher.check(model.name, run):
                break
        assert decision is not None  # the loop ran: a decision each time
        return self._plan(t0, now_s, parsed, view, ticket, match, predicted, req, decision, sticky is not None,
                          snapshot, recorded)

    def _plan(
        self, t0: float, now_s: float, parsed: ParsedRequest, view: PromptView, ticket: IndexTicket,
        match: MatchResult | None, predicted: dict[str, int], req: RequestView, decision: Decision,
        is_session_sticky: bool, snapshot: Snapshot | None = None, recorded: tuple[RequestView, Snapshot] | None = None,
    ) -> RoutePlan:
        """The plan for ``decision``: workers in order, pending or approximate index entries, the decision record
        (cost terms from ``recorded``, the inner policy's inputs under ``session_sticky``, else ``req``, ``snapshot``).

        Raises:
            NoWorkerError: the decision chose no worker.
        """
        chosen_id = decision.worker_id
        if chosen_id is None:
            raise NoWorkerError(f"no worker available for model {parsed.model!r}: {decision.reason}",
                                reason=decision.reason)
        workers = self._fleet.workers
        if chosen_id not in predicted:
            raise RuntimeError(f"the policy chose {chosen_id!r}, which is not a candidate")
        chosen = workers.get(chosen_id)
        if chosen is None:  # removed while the session store was awaited: the next ranked worker still here
            chosen_id = next((w for w in decision.ranking if w in workers and w in predicted), None)
            if chosen_id is None:
                raise NoWorkerError(f"no worker available for model {parsed.model!r}: the chosen worker was removed",
                                    reason="worker_removed")
            chosen = workers[chosen_id]
        ticket.insert_for(chosen, match, now_s)
        if req.session_key is not None and decision.reason != "forced":  # sessions placed by the policy
            self.assignments.add(chosen_id, len(predicted))
        calibrator = self.holder.calibrator
        factor = calibrator.speed_factor(chosen_id) if calibrator is not None else 1.0
        decision_s = time.perf_counter() - t0
        self.recent.append(DecisionRecord(
            req.request_id, parsed.model, chosen_id, decision.reason, decision.detail, req.session_key,
            view.num_tokens, predicted[chosen_id], decision.scores, predicted, decision_s, now_s,
            *(recorded or (req, snapshot)), self.holder.policy,
        ))
        return RoutePlan(decision, chosen, predicted, view.num_tokens, req.session_key, factor, decision_s, workers,
                         ticket, calibrator, is_session_sticky)
