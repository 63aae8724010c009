"""The TTFT cost model of ``cache_aware`` and its online correction.

Estimated time to first token of a request of ``n`` prompt tokens on worker ``w`` (seconds)::

    ttft(w) = overhead_s + f_w * (queue_s + prefill_s + restore_s)

    queue_s   = drained(w_i, a_i)                                  queued prefill work still ahead (see below),
                                                                   w_i = (n_i-k_i)/r_lin + (n_i**2-k_i**2)/r_quad
              + num_waiting_requests * per_waiting_request_s       scheduling delay per queued request
              + num_running_requests * per_running_request_s       decode work sharing each batch
    prefill_s = (n - k) / r_lin + (n**2 - k**2) / r_quad           positions k..n computed, k = cached tokens
    restore_s = k_cpu * kv_bytes_per_token / host_bandwidth        blocks only on the worker's CPU tier
              + k_pool * kv_bytes_per_token / pool_bandwidth       blocks only in the shared pool

where ``k = k_gpu + k_cpu + k_pool`` (each clamped so that ``k <= n``; GPU first, then CPU, then pool) and
``f_w`` is the worker's online speed factor (1.0 = as profiled; ``TTFTCalibrator``).

Queued prefill is priced as the request's own is: a queued prompt of ``n_i`` tokens with ``k_i`` cached costs
``(n_i - k_i) / r_lin + (n_i**2 - k_i**2) / r_quad`` before this request's first chunk runs (FCFS chunked prefill:
vLLM's scheduler, and the sim's, give the running prefills the step budget first). Counting only the linear part
priced a worker holding a long queued prompt as lighter than it is, by ``n_i * r_lin / r_quad`` of that prompt's
linear time (0.23 at 14K tokens, 1.6 at 100K), so the requests sent behind it waited longer than estimated: on the
demo's Mooncake slice the observed wait was 1.23-1.32 times the linear estimate in every band of queue length.

The queue drains while its requests wait (``drained_prefill_s``): the worker serves its pending prefills in
admission order at its profiled rate (``1 / f_w`` seconds of work per second), work-conserving from the time its
oldest pending prefill last finished, so what a new request waits behind is the work admitted minus the work done
since. With ``w_i`` the work of the pending request admitted at ``a_i`` (worker's clock, ascending), ``d`` the
time the worker last finished its oldest pending prefill (a later one finishing first was served beside it and
says nothing of the head) and ``t`` now, the Lindley recursion of a single FIFO server::

    R = 0, c = d
    for each pending i:  R = max(0, R - max(0, a_i - c) / f_w) + w_i,  c = max(c, a_i)
    drained = max(0, R - max(0, t - c) / f_w)

Charging the whole prefill of every pending request (the sums alone) priced a request half prefilled as if none
of it had run: queues longer than a few seconds came out about twice their observed wait. A request still pending
after its modelled work is done adds nothing more (the queue under-runs only while a first byte is late). Without
the pending list (``WorkerState.pending_prefills`` empty), the sums are the queue, as if admitted now.

Workers with a per-request step cap (``long_prefill_token_threshold`` ``T`` below the step budget ``B``, vLLM's
scheduler flags; ``workers.scheduler``): each prefill ahead takes at most ``T`` tokens of a step, so up to
``s = ceil(B / T) - 1`` of them run with budget left over, and the request runs beside them instead of after them.
Older prefills are served first (FCFS), so the ones it runs beside are the ``s`` youngest pending (its lanes, ``m``
of them, work ``W_y`` seconds over ``N_y`` uncached tokens). With ``D`` the drained queue above
(``shared_step_queue_s``)::

    wait   = max(0, D - W_y)                                    the older prefills, served before it starts
    beside = min(D - wait, steps * m * T * W_y / N_y)           the lanes' chunks in the steps it runs in,
    steps  = max(1, ceil((n - k) / (B - m * T)))                its own tokens at the budget the lanes leave
    queue_s's prefill part = wait + beside   (<= D: a cap never raises the estimate)

A short turn behind one long cold prefill (``m = 1``) then waits for one ``T``-token chunk of it per step it
runs in, not for all of it. With ``T = 0`` or ``T >= B`` (``s = 0``) the queue is ``D`` as above.

Why ``n**2``: the GEMMs of a transformer cost a constant per token, attention over a causal prefix of length n
costs ``~ 2 * n**2 * d_model * num_layers`` FLOPs (halved for causality, times 2 matmuls, times 2 FLOPs/MAC), so
computing positions ``k..n`` costs ``(n**2 - k**2)`` times a constant. Calibration for Llama-3-8B (32 layers,
d_model 4096, 8 B params) on one H200: a 32,768-token prefill takes 1.26 s (measured, ``DESIGN.md`` §1); the FLOP
split is 16 GFLOP/token linear vs 0.26 MFLOP/token**2 attention, i.e. 65 % / 35 % at 32K, giving
``r_lin = 40,000`` tokens/s and ``r_quad = 2.435e9`` tokens**2/s (32,768/40,000 + 32,768**2/2.435e9 = 1.260 s).
Restore: 131,072 B/token over 55 GB/s host-to-device is 78 ms for 32K tokens (measured, ``DESIGN.md`` §1).

The speed factor scales everything but the fixed overhead: a worker twice slower than its profile computes,
drains its queue and (usually, sharing the same host) restores twice slower.

Decode load (ranking only, not part of the TTFT estimate; seconds). Every sequence in a decode batch adds
``decode_s_per_sequence`` to each step and makes it read its KV cache (``kv_bytes_per_token`` per context token
at ``kv_read_bytes_per_s``), the step model of vLLM-style continuous batching (memory-bound decode). Placing a
request of ``n`` prompt tokens beside ``R`` running requests holding ``C`` context tokens makes each of its steps
slower by ``R * d + C * b`` and each of theirs by ``d + n * b`` (``d = decode_s_per_sequence``, ``b =
kv_bytes_per_token / kv_read_bytes_per_s``); over ``T = min(max_tokens, decode_horizon_tokens)`` steps::

    decode_load_s(w) = f_w * T * (R * (2 * d + n * b) + C * b)

``R`` is ``num_running_requests`` and ``C`` the prompt tokens of the requests in flight through the gateway
(``num_inflight_prompt_tokens``: a lower bound of their context, which grows by the tokens they generate). It is
the same quantity Dynamo's KV router charges as a worker's active decode blocks, here in seconds so that it adds
to the TTFT terms. Without it, requests sharing a long prefix all go to the worker holding it however many
sequences it already decodes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import msgspec

from policies.base import PendingPrefill, WorkerState
from policies.config import CacheAwareConfig

logger = logging.getLogger(__name__)

__all__ = ["TTFTBreakdown", "TTFTCalibrator", "TTFTCostModel", "drained_prefill_s", "num_threshold_lanes",
           "shared_step_queue_s"]


def num_threshold_lanes(max_num_batched_tokens: int, long_prefill_token_threshold: int) -> int:
    """``s = ceil(B / T) - 1``: how many prefills capped at ``T`` tokens a step fit in a budget of ``B`` tokens with
    budget left for the next request (module docstring); 0 when the cap is off (``T = 0``) or never binds
    (``T >= B``)."""
    threshold, budget = long_prefill_token_threshold, max_num_batched_tokens
    if threshold <= 0 or threshold >= budget:
        return 0
    return -(-budget // threshold) - 1


def shared_step_queue_s(
    pending: Sequence[PendingPrefill], queued_s: float, num_new_tokens: int, num_lanes: int,
    long_prefill_token_threshold: int, max_num_batched_tokens: int, s_per_token: float, s_per_token_sq: float,
) -> float:
    """The pending prefill a request waits for on a worker whose step cap binds (module docstring: ``wait +
    beside``), unscaled seconds; at most ``queued_s``. O(num_lanes).

    Args:
        pending: the worker's pending prefills in admission order (``WorkerState.pending_prefills``).
        queued_s: ``D``, the drained queue (``drained_prefill_s``), seconds.
        num_new_tokens: ``n - k``, the tokens the request computes there.
        num_lanes: ``s`` (``num_threshold_lanes``), at least 1.
        long_prefill_token_threshold: ``T``, tokens.
        max_num_batched_tokens: ``B``, tokens.
        s_per_token: ``1 / r_lin`` (seconds per token).
        s_per_token_sq: ``1 / r_quad`` (seconds per token pair).
    """
    num_lane_tokens = 0
    lane_work_s = 0.0
    m = 0
    for _admitted_at_s, num_tokens, num_token_pairs in reversed(pending):
        if m == num_lanes:
            break
        if num_tokens > 0:
            m += 1
            num_lane_tokens += num_tokens
            lane_work_s += num_tokens * s_per_token + num_token_pairs * s_per_token_sq
    if not m or queued_s <= 0.0:
        return queued_s
    wait_s = queued_s - lane_work_s if queued_s > lane_work_s else 0.0
    lanes_left_s = queued_s - wait_s
    lane_tokens_per_step = m * long_prefill_token_threshold
    num_steps = max(1, -(-num_new_tokens // (max_num_batched_tokens - lane_tokens_per_step)))
    beside_s = num_steps * lane_tokens_per_step * lane_work_s / num_lane_tokens
    return wait_s + (beside_s if beside_s < lanes_left_s else lanes_left_s)


def drained_prefill_s(
    pending: Sequence[PendingPrefill], done_at_s: float, now_s: float, s_per_token: float, s_per_token_sq: float,
    speed_factor: float = 1.0,
) -> float:
    """The pending prefill work still ahead of a request arriving at ``now_s``, unscaled (seconds of profiled work;
    the recursion in the module docstring). O(len(pending)).

    Args:
        pending: ``(admitted_at_s, num_uncached_tokens, num_uncached_token_pairs)`` per pending request, in
            admission order (``WorkerState.pending_prefills``).
        done_at_s: when the worker last finished a pending prefill; nothing pending was served before it.
        now_s: the decision time, on the same clock as the admissions (seconds).
        s_per_token: ``1 / r_lin`` (seconds per token).
        s_per_token_sq: ``1 / r_quad`` (seconds per token pair).
        speed_factor: ``f_w``: one second serves ``1 / f_w`` seconds of profiled work.
    """
    rate = 1.0 / speed_factor
    remaining_s = 0.0
    cursor_s = done_at_s
    for admitted_at_s, num_tokens, num_token_pairs in pending:
        if admitted_at_s > cursor_s:
            remaining_s -= (admitted_at_s - cursor_s) * rate
            if remaining_s < 0.0:
                remaining_s = 0.0
            cursor_s = admitted_at_s
        remaining_s += num_tokens * s_per_token + num_token_pairs * s_per_token_sq
    if now_s > cursor_s:
        remaining_s -= (now_s - cursor_s) * rate
    return remaining_s if remaining_s > 0.0 else 0.0


class TTFTBreakdown(msgspec.Struct, frozen=True, gc=False):
    """One worker's estimate, term by term (seconds), for the admin's decision list.

    Attributes:
        queue_s: queued work ahead, unscaled.
        prefill_s: prefill of the tokens the worker lacks, unscaled.
        restore_s: restore of blocks held only on CPU or in the pool, unscaled.
        overhead_s: fixed per-request time.
        speed_factor: the worker's online speed factor applied to the three terms above.
        ttft_s: ``overhead_s + speed_factor * (queue_s + prefill_s + restore_s)``.
        num_computed_tokens: prompt tokens the worker would compute.
        decode_load_s: the decode load of placing the request there, unscaled (ranking only; module docstring).
    """

    queue_s: float
    prefill_s: float
    restore_s: float
    overhead_s: float
    speed_factor: float
    ttft_s: float
    num_computed_tokens: int
    decode_load_s: float = 0.0


class TTFTCostModel:
    """Evaluates the formula in the module docstring; constants from a ``CacheAwareConfig``.

    Args:
        config: the policy configuration (rates in tokens/s and tokens**2/s, bandwidths in bytes/s).
    """

    def __init__(self, config: CacheAwareConfig) -> None:
        self.config = config
        self.s_per_token = 1.0 / config.prefill_linear_tokens_per_s
        self.s_per_token_sq = 1.0 / config.prefill_quadratic_tokens_sq_per_s
        self.host_s_per_token = config.kv_bytes_per_token / config.host_bandwidth_bytes_per_s
        self.pool_s_per_token = config.kv_bytes_per_token / config.pool_bandwidth_bytes_per_s
        self.overhead_s = config.overhead_s
        self.per_waiting_request_s = config.per_waiting_request_s
        self.per_running_request_s = config.per_running_request_s
        self.kv_read_s_per_token = config.kv_bytes_per_token / config.kv_read_bytes_per_s
        self.decode_s_per_sequence = config.decode_s_per_sequence
        self.num_lanes = num_threshold_lanes(config.max_num_batched_tokens, config.long_prefill_token_threshold)
        """``s`` of the module docstring (0: the queue is served whole before the request)."""

    def decode_load_s(self, worker: WorkerState, num_prompt_tokens: int, num_max_output_tokens: int) -> float:
        """The decode load of placing the request on ``worker``, unscaled (seconds; module docstring).

        Args:
            worker: the candidate (running requests, prompt tokens in flight).
            num_prompt_tokens: the request's prompt length ``n`` in tokens.
            num_max_output_tokens: the request's ``max_tokens``; at most ``decode_horizon_tokens`` are charged.
        """
        steps = min(num_max_output_tokens, self.config.decode_horizon_tokens)
        b = self.kv_read_s_per_token
        return steps * (
            worker.num_running_requests * (2.0 * self.decode_s_per_sequence + num_prompt_tokens * b)
            + worker.num_inflight_prompt_tokens * b
        )

    def work_s(self, worker: WorkerState, num_prompt_tokens: int) -> float:
        """The scalable part of the estimate, ``queue_s + prefill_s + restore_s``, unscaled (seconds; the terms of
        ``breakdown``).

        Args:
            worker: the candidate (cached tokens per tier, load).
            num_prompt_tokens: the request's prompt length ``n`` in tokens (>= 0).
        """
        terms = self.breakdown(worker, num_prompt_tokens)
        return terms.queue_s + terms.prefill_s + terms.restore_s

    def estimate_s(self, worker: WorkerState, num_prompt_tokens: int, speed_factor: float = 1.0) -> float:
        """Estimated TTFT in seconds: ``overhead_s + speed_factor * work_s(worker, num_prompt_tokens)`` (the
        ``ttft_s`` of ``breakdown``)."""
        return self.breakdown(worker, num_prompt_tokens, speed_factor).ttft_s

    def breakdown(
        self, worker: WorkerState, num_prompt_tokens: int, speed_factor: float = 1.0, num_max_output_tokens: int = 0,
    ) -> TTFTBreakdown:
        """The estimate term by term, with the decode load for a request of ``num_max_output_tokens`` (0: none).

        The one evaluation of the module docstring's formula: ``work_s`` and ``estimate_s`` read their numbers
        from it. ``CacheAwarePolicy.select`` inlines the same arithmetic on the request path (its scores equal
        ``ttft_s`` here; ``tests/policies`` checks both against values written out from the docstring).

        Args:
            worker: the candidate (cached tokens per tier, load).
            num_prompt_tokens: the request's prompt length ``n`` in tokens (>= 0).
            speed_factor: the worker's online factor ``f_w`` (1.0: as profiled).
            num_max_output_tokens: the request's ``max_tokens`` for the decode load (0: no decode load).
        """
        n = num_prompt_tokens
        k_gpu = min(worker.num_gpu_cached_tokens, n)
        k_cpu = min(worker.num_cpu_cached_tokens, n - k_gpu)
        k_pool = min(worker.num_pool_cached_tokens, n - k_gpu - k_cpu)
        k = k_gpu + k_cpu + k_pool
        if worker.pending_prefills:
            queued_prefill_s = drained_prefill_s(worker.pending_prefills, worker.prefill_done_at_s, worker.clock_s,
                                                 self.s_per_token, self.s_per_token_sq, speed_factor)
            if self.num_lanes:
                queued_prefill_s = shared_step_queue_s(
                    worker.pending_prefills, queued_prefill_s, n - k, self.num_lanes,
                    self.config.long_prefill_token_threshold, self.config.max_num_batched_tokens, self.s_per_token,
                    self.s_per_token_sq)
        else:
            queued_prefill_s = (worker.num_pending_prefill_tokens * self.s_per_token
                                + worker.num_pending_prefill_token_pairs * self.s_per_token_sq)
        queue_s = (
            queued_prefill_s
            + worker.num_waiting_requests * self.per_waiting_request_s
            + worker.num_running_requests * self.per_running_request_s
        )
        prefill_s = (n - k) * self.s_per_token + (n * n - k * k) * self.s_per_token_sq
        restore_s = k_cpu * self.host_s_per_token + k_pool * self.pool_s_per_token
        return TTFTBreakdown(
            queue_s=queue_s,
            prefill_s=prefill_s,
            restore_s=restore_s,
            overhead_s=self.overhead_s,
            speed_factor=speed_factor,
            ttft_s=self.overhead_s + speed_factor * (queue_s + prefill_s + restore_s),
            num_computed_tokens=n - k,
            decode_load_s=self.decode_load_s(worker, n, num_max_output_tokens) if num_max_output_tokens else 0.0,
        )


class TTFTCalibrator:
    """Per-worker speed factors learned from observed TTFTs (EWMA in log space, bounded).

    After each request the gateway reports what it predicted and what the worker showed. With ``o`` the fixed
    overhead and ``f_used`` the factor the prediction was made with, one observation gives the sample::

        f_sample = (observed_ttft_s - o) / ((predicted_ttft_s - o) / f_used)

    clamped to ``[min_speed_factor, max_speed_factor]``, and the factor moves to
    ``exp((1 - alpha) * log(f) + alpha * log(f_sample))``. Log space makes a 2x-slow and a 2x-fast error
    symmetric; after ``k`` consistent observations the remaining log error is ``(1 - alpha)**k`` of the first
    (alpha 0.25: 4 observations take a 2x-slow worker within 20 %). Observations whose unscaled work
    ``(predicted - o) / f_used`` is under ``min_calibration_work_s`` carry no signal and are skipped.

    The policy only reads ``speed_factor()``; ``observe()`` is the one writer (the gateway, after the first
    token). Both are O(1) and never raise for bad measurements: those are counted in ``num_rejected`` and logged.

    Args:
        config: supplies ``overhead_s``, ``calibration_alpha``, the factor bounds and ``min_calibration_work_s``.
        initial_speed_factors: factors to start from (a hot reload keeps what was learned), clamped to bounds.
    """

    def __init__(self, config: CacheAwareConfig, initial_speed_factors: dict[str, float] | None = None) -> None:
        self.config = config
        self._log_factors: dict[str, float] = {}
        self._log_view: Mapping[str, float] = MappingProxyType(self._log_factors)
        self._log_min = math.log(config.min_speed_factor)
        self._log_max = math.log(config.max_speed_factor)
        self.num_observations = 0
        self.num_skipped = 0
        self.num_rejected = 0
        for worker_id, factor in (initial_speed_factors or {}).items():
            if math.isfinite(factor) and factor > 0:
                self._log_factors[worker_id] = min(max(math.log(factor), self._log_min), self._log_max)

    def speed_factor(self, worker_id: str) -> float:
        """The worker's current factor (1.0 until observed)."""
        log_factor = self._log_factors.get(worker_id)
        return 1.0 if log_factor is None else math.exp(log_factor)

    def log_speed_factors_view(self) -> Mapping[str, float]:
        """Read-only live view of the learned factors **in log space** (for the policy's hot loop)."""
        return self._log_view

    def speed_factors(self) -> dict[str, float]:
        """Every learned factor, by worker id (for the admin API and metrics)."""
        return {worker_id: math.exp(v) for worker_id, v in self._log_factors.items()}

    def forget(self, worker_id: str) -> None:
        """Drop what was learned about a worker (removed or restarted)."""
        self._log_factors.pop(worker_id, None)

    def observe(
        self,
        worker_id: str,
        predicted_ttft_s: float,
        observed_ttft_s: float,
        *,
        speed_factor_used: float | None = None,
    ) -> bool:
        """Fold one observation into the worker's factor.

        Args:
            worker_id: the worker that served the request.
            predicted_ttft_s: the policy's score for that worker at decision time (``Decision.scores``), seconds.
            observed_ttft_s: time from sending the request to the first token, seconds.
            speed_factor_used: ``speed_factor(worker_id)`` at decision time; ``None`` uses the current factor
                (exact when nothing else was observed in between).

        Returns:
            True when the factor was updated; False when the observation was skipped (too little work to tell)
            or rejected (non-finite or negative values, which are counted and logged).
        """
        if speed_factor_used is None:
            speed_factor_used = self.speed_factor(worker_id)
        # Finite and non-negative (positive for the factor); NaN fails every comparison.
        if not (
            0.0 <= predicted_ttft_s < math.inf and 0.0 <= observed_ttft_s < math.inf
            and 0.0 < speed_factor_used < math.inf
        ):
            self.num_rejected += 1
            logger.warning(
                "ttft observation rejected: worker=%s predicted_ttft_s=%r observed_ttft_s=%r speed_factor_used=%r",
                worker_id,
                predicted_ttft_s,
                observed_ttft_s,
                speed_factor_used,
            )
            return False
        overhead_s = self.config.overhead_s
        unscaled_work_s = (predicted_ttft_s - overhead_s) / speed_factor_used
        if unscaled_work_s < self.config.min_calibration_work_s:
            self.num_skipped += 1
            return False
        observed_work_s = observed_ttft_s - overhead_s
        if observed_work_s <= 0.0:
            log_sample = self._log_min
        else:
            log_sample = min(max(math.log(observed_work_s / unscaled_work_s), self._log_min), self._log_max)
        alpha = self.config.calibration_alpha
        log_old = self._log_factors.get(worker_id, 0.0)
        log_new = (1.0 - alpha) * log_old + alpha * log_sample
        self._log_factors[worker_id] = min(max(log_new, self._log_min), self._log_max)
        self.num_observations += 1
        return True
