"""The simulated engine: no model, a timing model calibrated to an H200, deterministic sampled tokens.

Step time (seconds), from ``TimingProfile`` (``workers.config``)::

    step_s = step_overhead_s                                                  (any step with compute)
           + sum over prefill chunks of  n * prefill_s_per_token
                                       + attention_s_per_token_pair * n * (c + n / 2)
                                                      (n new tokens, c tokens already in context)
           + num_decodes * decode_s_per_seq
           + (sum over decodes of context tokens) * kv_bytes_per_token / kv_read_bytes_per_s
           + num_state_copies * copy_latency_s                    (hybrid models: recurrent-state checkpoints,
           + 2 * state_copy_bytes / kv_read_bytes_per_s            read and written in device memory,
           + state_restore_bytes / host_to_gpu_bytes_per_s         or brought back from host memory,
           + num_state_pool_restores * pool_latency_s              or read back from the shared pool)
           + state_pool_restore_bytes / pool_bytes_per_s

A hybrid request resumed without a usable checkpoint is admitted with the shorter hit the last checkpoint allows
(``workers.kv.hybrid``), so its recurrent replay is charged as the prefill of every token after it.

Copies run on two copy engines (one per direction) beside the compute, FIFO each::

    copy_s = copy_latency_s + num_blocks * block_size * kv_bytes_per_token / bandwidth
             (host_to_gpu_bytes_per_s for restores, gpu_to_host_bytes_per_s for stores)

Shared pool copies (``pool_stores`` / ``pool_restores``) run the same way on two more FIFO lanes, at
``pool_bytes_per_s`` with ``pool_latency_s`` per job. A job issued at simulated time t starts at max(t, when
its engine frees up). A step with no compute but copies in flight lasts until the next copy lands. The engine
keeps its own simulated clock (``clock_s``).

Sampled token for a sequence at position p: ``splitmix64(seed * 0x9E3779B97F4A7C15 + p)`` picks an id from
``output_token_ids``; when ``eos_probability`` > 0 the top 53 bits, read as a fraction, below it give EOS.
Outputs depend only on (seed, position): deterministic across runs and batch compositions.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from workers.config import TimingProfile
from workers.engines.base import BlockCopy, ScheduledStep, StepResult

logger = logging.getLogger(__name__)

U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """SplitMix64 finalizer (Steele, Lea, Flood 2014): a well-mixed u64 of ``x``."""
    x = (x + GOLDEN) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


class TimingModel:
    """The formulas of the module docstring over a ``TimingProfile``."""

    def __init__(self, profile: TimingProfile, block_size: int) -> None:
        self.profile = profile
        self.block_size = block_size

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """Compute time of one prefill chunk, without the step overhead."""
        p = self.profile
        n = num_new_tokens
        return n * p.prefill_s_per_token + p.attention_s_per_token_pair * n * (num_context_tokens + n / 2)

    def decode_s(self, num_seqs: int, num_context_tokens: int) -> float:
        """Decode part of a step for ``num_seqs`` sequences reading ``num_context_tokens`` KV tokens in all."""
        p = self.profile
        return num_seqs * p.decode_s_per_seq + num_context_tokens * p.kv_bytes_per_token / p.kv_read_bytes_per_s

    def step_s(self, step: ScheduledStep) -> float:
        """Duration of a step's compute (0 when it computes nothing)."""
        if not step.prefills and not step.decodes:
            return 0.0
        total = self.profile.step_overhead_s
        for chunk in step.prefills:
            total += self.prefill_s(len(chunk.token_ids), chunk.start_pos)
        if step.decodes:
            total += self.decode_s(len(step.decodes), sum(d.position for d in step.decodes))
        if step.num_state_copies:
            p = self.profile
            total += (
                step.num_state_copies * p.copy_latency_s
                + 2 * step.state_copy_bytes / p.kv_read_bytes_per_s
                + step.state_restore_bytes / p.host_to_gpu_bytes_per_s
            )
        if step.num_state_pool_restores:
            p = self.profile
            total += (
                step.num_state_pool_restores * p.pool_latency_s + step.state_pool_restore_bytes / p.pool_bytes_per_s
            )
        return total

    def copy_s(self, num_blocks: int, bytes_per_s: float, latency_s: float | None = None) -> float:
        """Duration of one copy job of ``num_blocks`` blocks (``latency_s``: default ``copy_latency_s``)."""
        p = self.profile
        lat = p.copy_latency_s if latency_s is None else latency_s
        return lat + num_blocks * self.block_size * p.kv_bytes_per_token / bytes_per_s


class SimEngine:
    """Implements ``workers.engines.base.Engine`` with the timing model (module docstring)."""

    name = "sim"

    def __init__(
        self,
        profile: TimingProfile,
        block_size: int,
        output_token_ids: Sequence[int],
        eos_token_id: int | None,
    ) -> None:
        """Build the engine at simulated time 0.

        Args:
            profile: timing constants.
            block_size: tokens per block (copy sizes).
            output_token_ids: ids sampled tokens are drawn from (non-empty).
            eos_token_id: id emitted as EOS, or ``None`` (then no EOS is ever sampled).

        Raises:
            ValueError: empty ``output_token_ids``.
        """
        if not output_token_ids:
            raise ValueError("output_token_ids must not be empty")
        self.timing = TimingModel(profile, block_size)
        self._vocab = tuple(output_token_ids)
        self._eos_id = eos_token_id
        self._eos_threshold = int(profile.eos_probability * (1 << 53)) if eos_token_id is not None else 0
        self.clock_s = 0.0
        self._h2d_free_at_s = 0.0
        self._d2h_free_at_s = 0.0
        self._pool_in_free_at_s = 0.0
        self._pool_out_free_at_s = 0.0
        self._stores: list[tuple[float, int]] = []
        self._restores: list[tuple[float, int]] = []
        self.num_steps = 0
        self.busy_s = 0.0

    def sample(self, seed: int, position: int) -> int:
        """The token sampled at ``position`` for ``seed`` (module docstring)."""
        h = splitmix64((seed * GOLDEN + position) & U64)
        if self._eos_threshold and (h >> 11) < self._eos_threshold and self._eos_id is not None:
            return self._eos_id
        return self._vocab[h % len(self._vocab)]

    def _issue(
        self,
        jobs: Sequence[BlockCopy],
        free_at_s: float,
        bytes_per_s: float,
        heap: list[tuple[float, int]],
        latency_s: float | None = None,
    ) -> float:
        for job in jobs:
            start = max(self.clock_s, free_at_s)
            n = max(len(job.src_block_ids), len(job.dst_block_ids))
            free_at_s = start + self.timing.copy_s(n, bytes_per_s, latency_s)
            heapq.heappush(heap, (free_at_s, job.job_id))
        return free_at_s

    def execute(self, step: ScheduledStep) -> StepResult:
        """Advance the simulated clock by the step (module docstring) and sample tokens."""
        p = self.timing.profile
        self._h2d_free_at_s = self._issue(step.restores, self._h2d_free_at_s, p.host_to_gpu_bytes_per_s, self._restores)
        self._d2h_free_at_s = self._issue(step.stores, self._d2h_free_at_s, p.gpu_to_host_bytes_per_s, self._stores)
        if step.pool_stores:
            self._pool_out_free_at_s = self._issue(
                step.pool_stores, self._pool_out_free_at_s, p.pool_bytes_per_s, self._stores, p.pool_latency_s
            )
        if step.pool_restores:
            self._pool_in_free_at_s = self._issue(
                step.pool_restores, self._pool_in_free_at_s, p.pool_bytes_per_s, self._restores, p.pool_latency_s
            )
        duration = self.timing.step_s(step)
        if duration == 0.0 and (self._stores or self._restores):
            nxt = min(h[0][0] for h in (self._stores, self._restores) if h)
            duration = max(0.0, nxt - self.clock_s)
        end = self.clock_s + duration
        done_stores: list[int] = []
        while self._stores and self._stores[0][0] <= end:
            done_stores.append(heapq.heappop(self._stores)[1])
        done_restores: list[int] = []
        while self._restores and self._restores[0][0] <= end:
            done_restores.append(heapq.heappop(self._restores)[1])
        self.clock_s = end
        sampled: dict[str, int] = {}
        for chunk in step.prefills:
            if chunk.sample:
                sampled[chunk.request_id] = self.sample(chunk.sampling.seed, chunk.start_pos + len(chunk.token_ids))
        for d in step.decodes:
            sampled[d.request_id] = self.sample(d.sampling.seed, d.position + 1)
        if duration:
            self.num_steps += 1
            self.busy_s += duration
        return StepResult(sampled, duration, tuple(done_stores), tuple(done_restores))

    def has_pending_copies(self) -> bool:
        """Whether a store or restore has not landed yet."""
        return bool(self._stores or self._restores)

    def close(self) -> None:
        """Nothing to release."""
