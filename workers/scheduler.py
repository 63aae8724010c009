"""Continuous-batching scheduler: FCFS, chunked prefill, preemption by recompute, restores from the CPU tier.

Each step (``schedule`` then, after the engine ran it, ``update``)::

    budget = max_num_batched_tokens
    1. running requests, oldest first: each gets min(tokens it still has to compute, threshold, budget) tokens
       (a decode is 1; ``threshold`` is ``long_prefill_token_threshold`` when above 0, else no cap). When its
       blocks cannot grow, the newest running request is preempted (blocks freed, computed tokens reset, pushed
       back to the front of the waiting queue) until they can, or it preempts itself.
    2. if nothing was preempted: waiting requests, oldest first, while budget > 0 and running + restoring <
       max_num_seqs: find the cached prefix (GPU, then CPU). A CPU continuation is admitted only when GPU blocks
       can be reserved to receive it (plus its first chunk); the request then waits in RESTORING until the copy
       lands and runs from the next step. Otherwise its first chunk, capped as in 1., is scheduled. The first
       request that cannot be admitted stops the scan (FCFS: no one jumps the queue).

Held prefixes (``hold_prefix_on_arrival``): ``add_request`` looks up the request's GPU prefix hit at once and takes
a reference on those blocks (``Request.held_block_ids``), so they leave the free queue and the allocations of the
requests ahead evict every other free block first; the reference is dropped when the request is admitted (its own
hit holds them from then on) or finished while waiting. A hold only reorders eviction, it never costs a preemption
or an admission: when a running request cannot grow, or the head of the queue cannot be admitted, and the holds of
other waiting requests would make the room, those holds are dropped, newest request first, before anything is
preempted or the scan stops.

Pool reads off the step (``workers.kv.manager``): a restore whose pool read runs on the I/O thread waits in
RESTORING like any restore (its blocks reserved) while the others run; ``schedule`` first applies the reads that
finished (``KVCacheManager.take_finished_reads``). A read that came back short leaves the request with a shorter
hit: it computes from there, and, if this admission set its cached tokens, reports the shorter hit.

``update`` advances computed tokens, registers full blocks (events, write-through stores), appends sampled
tokens, finishes requests (EOS unless ``ignore_eos``, a stop token, ``max_tokens``, ``max_model_len``) and
applies finished copies. ``finish_request`` (client disconnect, stop string) frees blocks at once.

Disaggregated prefill/decode (``workers.handoff`` drives it):

* prefill side: a request with ``park_on_finish`` that finishes by length (vLLM delays the free only for
  ``FINISHED_LENGTH_CAPPED``) is **parked**: its blocks stay referenced for the decode side. The blocks have two
  readers, the transfer and the write-through stores to lower tiers the request issued; they are freed only when
  both are done (``release_transfer_reader`` and the last of ``Request.store_job_ids`` completing), in either order.
* decode side: ``add_receiving`` admits a request whose prompt KV comes from a remote worker: it takes the local
  GPU prefix hit and allocates blocks for the whole prompt now (the reservation; False when the blocks or
  ``max_num_seqs`` cannot be had), and the request waits in RECEIVING, holding them, until ``finish_receiving``
  registers the received blocks in the prefix index (``BlockStored``) and lets it run from the last prompt
  token (recomputed for its logits, as vLLM does).
"""

from __future__ import annotations

import logging
from collections import deque
from enum import StrEnum

import msgspec

from workers.config import SchedulerConfig
from workers.engines.base import DecodeSeq, PrefillChunk, SamplingParams, ScheduledStep, StepResult
from workers.errors import KVCacheError
from workers.kv.manager import KVCacheManager
from workers.kv.sequence import PrefixHit, SequenceKV

logger = logging.getLogger(__name__)


class RequestStatus(StrEnum):
    """Life cycle of a request in the scheduler."""

    WAITING = "waiting"
    RESTORING = "restoring"
    RECEIVING = "receiving"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One generation request.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt.
        all_token_ids: prompt then outputs.
        max_tokens: output tokens at most.
        ignore_eos: keep generating past EOS.
        stop_token_ids: tokens that end generation (not included in the output).
        sampling: sampling parameters given to the engine.
        num_computed_tokens: tokens whose KV is in the request's blocks.
        num_cached_tokens: prompt tokens served from the cache at first admission (any tier), ``None`` before.
        num_cached_tokens_by_medium: those tokens as ``(GPU, CPU, pool)``: the GPU hit, then the restores.
        status: life cycle state.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished.
        num_preemptions: times preempted.
        park_on_finish: a prefill leg: keep the blocks for a decode worker when it finishes by length.
        store_job_ids: write-through store jobs this request issued that have not landed (tracked for parked
            requests only: their blocks are freed after the last one).
        is_transfer_pending: parked and not yet pulled (or expired).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "max_tokens",
        "ignore_eos",
        "stop_token_ids",
        "sampling",
        "kv",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_cached_tokens_by_medium",
        "status",
        "finish_reason",
        "num_preemptions",
        "restore_job_id",
        "park_on_finish",
        "store_job_ids",
        "is_transfer_pending",
        "held_block_ids",
        "cached_set_by_restore",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool = False,
        stop_token_ids: frozenset[int] = frozenset(),
        lora_name: str | None = None,
        cache_salt: str | None = None,
        park_on_finish: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.stop_token_ids = stop_token_ids
        self.sampling = sampling
        self.kv = SequenceKV(request_id, lora_name, cache_salt)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_cached_tokens_by_medium: tuple[int, int, int] = (0, 0, 0)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.restore_job_id: int | None = None
        self.park_on_finish = park_on_finish
        self.store_job_ids: set[int] = set()
        self.is_transfer_pending = False
        self.held_block_ids: tuple[int, ...] = ()
        self.cached_set_by_restore = False
        """``num_cached_tokens`` was set by the admission whose restore is in flight (a short read lowers it)."""

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)


class RequestOutput(msgspec.Struct, gc=False):
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens sampled this step (0 or 1).
        finish_reason: set when the request finished this step.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None


class Scheduler:
    """FCFS continuous batching over a ``KVCacheManager`` (module docstring)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_id: int | None) -> None:
        """Build an empty scheduler.

        Args:
            config: batching limits.
            kv: the KV manager (shared with nobody else).
            eos_token_id: the tokenizer's EOS id, or ``None``.
        """
        self.config = config
        self.kv = kv
        self.eos_token_id = eos_token_id
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._restoring: dict[int, Request] = {}
        self._num_restoring = 0
        self._scheduled: list[tuple[Request, int]] = []
        self._freed: list[str] = []
        self.num_preemptions = 0
        self.parked: dict[str, Request] = {}
        """Prefill side: finished requests whose blocks wait for their readers (module docstring)."""
        self.receiving: dict[str, Request] = {}
        """Decode side: requests holding blocks while their KV arrives from a remote worker."""
        self._store_owner: dict[int, Request] = {}
        self._num_held_blocks = 0
        """Blocks referenced by the holds of waiting requests (module docstring), counted once per hold."""

    @property
    def num_running(self) -> int:
        """Running plus restoring plus receiving requests."""
        return len(self.running) + self._num_restoring + len(self.receiving)

    @property
    def num_parked_blocks(self) -> int:
        """GPU blocks held by parked requests (prefill side)."""
        return sum(len(r.kv.block_ids) for r in self.parked.values())

    @property
    def num_receiving_blocks(self) -> int:
        """GPU blocks reserved by receiving requests (decode side), local prefix hits included."""
        return sum(len(r.kv.block_ids) for r in self.receiving.values())

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission."""
        return len(self.waiting)

    def has_work(self) -> bool:
        """Whether a step would compute anything, is waiting on a restore, or has copies to issue."""
        kv = self.kv
        return bool(self.running or self.waiting or self._restoring or kv.has_pending_copies() or kv.has_io_in_flight())

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (FCFS).

        Raises:
            ValueError: a duplicate request id.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.config.hold_prefix_on_arrival:
            tokens = request.all_token_ids
            held = self.kv.find_gpu_prefix(request.kv, tokens, len(tokens))
            if held:
                self.kv.gpu.touch(held)
                request.held_block_ids = held
                self._num_held_blocks += len(held)

    def _release_hold(self, req: Request) -> None:
        """Drop ``req``'s reference on its held prefix (module docstring), if any."""
        if req.held_block_ids:
            self.kv.gpu.free(reversed(req.held_block_ids))
            self._num_held_blocks -= len(req.held_block_ids)
            req.held_block_ids = ()

    def _release_newest_hold(self, keep: Request | None = None) -> bool:
        """Drop the hold of the newest waiting request that has one (not ``keep``'s); False when none had one."""
        for req in reversed(self.waiting):
            if req.held_block_ids and req is not keep:
                self._release_hold(req)
                return True
        return False

    def finish_request(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a request now (disconnect, stop string) and free its blocks at once.

        Returns:
            False if the request is unknown or already finished.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._release_hold(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.RECEIVING:
            del self.receiving[request_id]
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason != "abort":
            self.kv.end_turn(req.kv)  # hybrid models: the generation-end checkpoint
        self._freed.append(request_id)
        if req.park_on_finish and reason == "length":
            req.is_transfer_pending = True
            self.parked[request_id] = req
            return True
        self._drop_store_owner(req)
        self.kv.free(req.kv)  # a restoring request keeps its blocks until the copy lands
        return True

    def _drop_store_owner(self, req: Request) -> None:
        for job_id in req.store_job_ids:
            self._store_owner.pop(job_id, None)
        req.store_job_ids.clear()

    def release_transfer_reader(self, request_id: str) -> bool:
        """The decode side pulled a parked request's blocks (or the wait for it expired): drop that reader.

        The blocks are freed now if no store the request issued is still in flight, else when the last lands.

        Returns:
            False if ``request_id`` is not parked or its transfer reader was already released.
        """
        req = self.parked.get(request_id)
        if req is None or not req.is_transfer_pending:
            return False
        req.is_transfer_pending = False
        self._maybe_unpark(req)
        return True

    def _maybe_unpark(self, req: Request) -> None:
        if req.is_transfer_pending or req.store_job_ids:
            return
        del self.parked[req.request_id]
        self.kv.free(req.kv)

    def add_receiving(self, request: Request) -> bool:
        """Admit a decode-side request whose prompt KV comes from a remote worker (module docstring).

        Takes the GPU prefix hit and allocates blocks covering the whole prompt, all or nothing.

        Returns:
            False (nothing changed) when ``max_num_seqs`` requests already run or the free blocks cannot cover
            the prompt; the caller refuses the transfer.

        Raises:
            ValueError: a duplicate request id.
        """
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid}")
        if self.num_running >= self.config.max_num_seqs:
            return False
        tokens = request.all_token_ids
        hit = self.kv.find_prefix(request.kv, tokens, len(tokens))
        gpu_hit = PrefixHit(hit.gpu_block_ids, 0, hit.block_size, 0, tokens)
        if not self.kv.admit(request.kv, gpu_hit, len(tokens)):
            return False
        request.num_cached_tokens = min(gpu_hit.num_cached_tokens, request.num_prompt_tokens)
        request.num_computed_tokens = gpu_hit.num_cached_tokens
        request.status = RequestStatus.RECEIVING
        self.requests[rid] = request
        self.receiving[rid] = request
        return True

    def finish_receiving(self, request_id: str) -> bool:
        """A receiving request's KV landed: register its full prompt blocks as cached and let it run from its
        last prompt token.

        Returns:
            False if the request is no longer receiving (aborted meanwhile).
        """
        req = self.receiving.pop(request_id, None)
        if req is None:
            return False
        n = req.num_prompt_tokens
        self.kv.cache_computed(req.kv, req.all_token_ids, n, n)
        req.num_computed_tokens = n - 1
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    # scheduling ----------------------------------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.kv)
        req.kv = SequenceKV(req.request_id, req.kv.lora_name, req.kv.cache_salt)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduledStep:
        """Pick this step's work (module docstring) and collect copies to issue."""
        for job_id in self.kv.take_finished_reads():
            self._restore_done(job_id)
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        bs = self.kv.block_size
        running = self.running
        RUNNING = RequestStatus.RUNNING
        scheduled: list[tuple[Request, int]] = []
        prefills: list[PrefillChunk] = []
        decodes: list[DecodeSeq] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            all_ids = req.all_token_ids
            start = req.num_computed_tokens
            num_new = len(all_ids) - start
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            kv = req.kv
            if start + num_new > len(kv.block_ids) * bs:
                while not self.kv.allocate_slots(kv, start + num_new):
                    if self._num_held_blocks and self._release_newest_hold():
                        continue  # a hold yields before a running request is preempted
                    victim = running[-1]
                    preempted = True
                    self._preempt(victim)
                    if victim is req:
                        break
                if req.status is not RUNNING:
                    break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        if not preempted:
            self._admit_waiting(budget, scheduled)
        self._scheduled = scheduled
        for req, num_new in scheduled:
            all_ids = req.all_token_ids
            start = req.num_computed_tokens
            end = start + num_new
            if num_new == 1 and end == len(all_ids) and len(all_ids) > len(req.prompt_token_ids):
                decodes.append(DecodeSeq(req.request_id, all_ids[start], start, req.kv.block_ids, req.sampling))
            else:
                prefills.append(
                    PrefillChunk(
                        req.request_id,
                        tuple(all_ids[start:end]),
                        start,
                        req.kv.block_ids,
                        end == len(all_ids),
                        req.sampling,
                    )
                )
        stores, restores = self.kv.take_copies()
        pool_stores, pool_restores = self.kv.take_pool_copies()
        freed, self._freed = tuple(self._freed), []
        costs = self.kv.take_checkpoint_costs()
        return ScheduledStep(
            tuple(prefills),
            tuple(decodes),
            stores,
            restores,
            freed,
            pool_stores,
            pool_restores,
            num_state_copies=costs.num_commits + costs.num_cpu_restores,
            state_copy_bytes=costs.commit_bytes,
            state_restore_bytes=costs.cpu_restore_bytes,
            num_state_pool_restores=costs.num_pool_restores,
            state_pool_restore_bytes=costs.pool_restore_bytes,
        )

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        threshold = self.config.long_prefill_token_threshold
        while self.waiting and budget > 0 and self.num_running < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            hit = self.kv.find_prefix(req.kv, tokens, len(tokens))
            num_cached = hit.num_cached_tokens
            num_new = len(tokens) - num_cached
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if not self.kv.admit(req.kv, hit, num_cached + num_new):
                others = self._num_held_blocks - len(req.held_block_ids)
                needed = -(-(num_cached + num_new) // self.kv.block_size) - len(hit.gpu_block_ids)
                if others and needed <= self.kv.gpu.num_free_blocks + others and self._release_newest_hold(req):
                    continue  # the holds behind the head yield to its admission; retry it
                break
            self._release_hold(req)
            num_cached = req.kv.num_cached_blocks * self.kv.block_size  # a pool fetch may shorten the hit
            self.waiting.popleft()
            first_admission = req.num_cached_tokens is None
            if first_admission:
                self._set_cached(req, num_cached, len(hit.gpu_block_ids), hit.num_cpu_blocks)
            req.num_computed_tokens = num_cached
            if req.kv.restore_job_id is not None:
                req.cached_set_by_restore = first_admission
                req.status = RequestStatus.RESTORING
                for job_id in req.kv.restore_job_ids:
                    self._restoring[job_id] = req
                self._num_restoring += 1
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

    def _set_cached(self, req: Request, num_cached: int, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Record the prompt tokens served from the cache at the first admission, by tier (GPU, CPU, pool)."""
        bs = self.kv.block_size
        req.num_cached_tokens = total = min(num_cached, req.num_prompt_tokens)
        num_gpu = min(num_gpu_blocks * bs, total)
        num_cpu = min(num_cpu_blocks * bs, total - num_gpu)
        req.num_cached_tokens_by_medium = (num_gpu, num_cpu, total - num_gpu - num_cpu)

    # results -------------------------------------------------------------------------------------------------

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Apply an engine step's result (module docstring).

        Returns:
            One output per request that sampled a token or finished this step, in scheduling order.

        Raises:
            KVCacheError: a finished copy job the KV manager does not know.
        """
        outputs: list[RequestOutput] = []
        sampled = result.sampled_token_ids
        max_len = self.config.max_model_len
        eos = self.eos_token_id
        kv = self.kv
        bs = kv.block_size
        RUNNING = RequestStatus.RUNNING
        for req, num_new in self._scheduled:
            if req.status is not RUNNING:
                continue  # finished (aborted) while the step ran
            computed = req.num_computed_tokens = req.num_computed_tokens + num_new
            if computed // bs > req.kv.num_cached_blocks:
                job_ids = kv.cache_computed(req.kv, req.all_token_ids, computed, len(req.prompt_token_ids))
                if job_ids and req.park_on_finish:
                    req.store_job_ids.update(job_ids)
                    for job_id in job_ids:
                        self._store_owner[job_id] = req
            token = sampled.get(req.request_id)
            if token is None:
                continue
            reason: str | None = None
            if (token == eos and not req.ignore_eos) or token in req.stop_token_ids:
                reason = "stop"
                new: list[int] = []
            else:
                all_ids = req.all_token_ids
                all_ids.append(token)
                new = [token]
                if len(all_ids) - len(req.prompt_token_ids) >= req.max_tokens or len(all_ids) >= max_len:
                    reason = "length"
            if reason is not None:
                self.finish_request(req.request_id, reason)
            outputs.append(RequestOutput(req.request_id, new, reason))
        self._scheduled = []
        for job_id in result.finished_store_job_ids:
            self.kv.complete_store(job_id)
            owner = self._store_owner.pop(job_id, None)
            if owner is not None:
                owner.store_job_ids.discard(job_id)
                if owner.request_id in self.parked:
                    self._maybe_unpark(owner)
        for job_id in result.finished_restore_job_ids:
            self._restore_done(job_id)
        return outputs

    def _restore_done(self, job_id: int) -> None:
        seq = self.kv.complete_restore(job_id)
        req = self._restoring.pop(job_id, None)
        if req is None:
            raise KVCacheError(f"restore job {job_id} has no request")
        if seq is None:
            return  # other jobs of the same restore still in flight
        self._num_restoring -= 1
        set_by_restore, req.cached_set_by_restore = req.cached_set_by_restore, False
        if seq.is_freed or req.status is RequestStatus.FINISHED:
            return
        num_cached = seq.num_cached_blocks * self.kv.block_size
        if num_cached < req.num_computed_tokens:  # a pool read came back short: compute from its end
            req.num_computed_tokens = num_cached
            if set_by_restore:
                gpu, cpu, _ = req.num_cached_tokens_by_medium
                bs = self.kv.block_size
                self._set_cached(req, num_cached, gpu // bs, cpu // bs)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
