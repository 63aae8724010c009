"""How late an event loop runs a 1 ms timer, and where the loop thread's time went while it was late.

``LagProbe.run`` sleeps 1 ms in a loop on the running event loop and reads four clocks at every wake-up: the wall
clock, the loop thread's CPU time (``time.thread_time``), the loop thread's time spent runnable but waiting for a
core (Linux ``/proc/thread-self/schedstat``, field 2, ns; ``None`` elsewhere) and the whole process's CPU time.
Between two wake-ups the loop thread was, besides the 1 ms asked for::

    wall - 1 ms = lag = cpu          running (its own steps: this and every other ready callback, the probe's)
                      + run_queue    runnable, no core free (the process's other threads or other processes held it)
                      + blocked      neither: waiting for the GIL (the loop does no blocking call but its poll,
                                     whose timeout is the probe's own deadline)

``LagSummary`` reports the lag's maximum and p99, the worst interval's split into those three parts, and the
process's CPU in it per wall second (how many cores its threads kept busy: near the host's core count, the
process saturates it by itself).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

SLEEP_S = 0.001
LAG_BUDGET_S = 0.005
"""A routing step may hold the loop this long (issue 21's target); intervals later than it are summed apart."""


def _schedstat_fd() -> int | None:
    try:
        return os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return None


def _run_queue_s(fd: int | None) -> float:
    """Seconds the thread that opened ``fd`` has waited runnable for a core (0.0 without schedstat)."""
    if fd is None:
        return 0.0
    return int(os.pread(fd, 64, 0).split()[1]) * 1e-9


@dataclass(frozen=True)
class LagSummary:
    """The probe's lateness over a run (seconds).

    Attributes:
        max_s: the worst lateness.
        p99_s: the 99th percentile.
        num_samples: wake-ups.
        worst_cpu_s: the loop thread's CPU time in the worst interval.
        worst_run_queue_s: its time runnable without a core there (0.0 where schedstat is absent).
        worst_blocked_s: the rest of the worst lateness: waits for the GIL.
        worst_process_cores: the process's CPU time in the worst interval per second of it.
        has_run_queue: schedstat was read (Linux).
        over_s: the lateness of every interval later than ``LAG_BUDGET_S``, summed.
        over_cpu_s, over_run_queue_s, over_blocked_s: its parts, summed over those intervals.
    """

    max_s: float
    p99_s: float
    num_samples: int
    worst_cpu_s: float
    worst_run_queue_s: float
    worst_blocked_s: float
    worst_process_cores: float
    has_run_queue: bool
    over_s: float = 0.0
    over_cpu_s: float = 0.0
    over_run_queue_s: float = 0.0
    over_blocked_s: float = 0.0

    def over_split(self) -> str:
        """The lateness past ``LAG_BUDGET_S`` summed, and its parts' shares: ``ms cpu%/run-queue%/GIL%``."""
        if self.over_s <= 0.0:
            return "0"
        total = self.over_cpu_s + self.over_run_queue_s + self.over_blocked_s
        return (f"{self.over_s * 1e3:.0f} {self.over_cpu_s / total:.0%}/{self.over_run_queue_s / total:.0%}/"
                f"{self.over_blocked_s / total:.0%}")

    def split(self) -> str:
        """The worst lateness's parts in milliseconds: ``cpu/run-queue/GIL, cores``."""
        queue = f"{self.worst_run_queue_s * 1e3:.1f}" if self.has_run_queue else "n/a"
        return (f"{self.worst_cpu_s * 1e3:.1f}/{queue}/{self.worst_blocked_s * 1e3:.1f}"
                f" {self.worst_process_cores:.1f}")


class LagProbe:
    """A task that sleeps ``SLEEP_S`` in a loop until ``stop`` and records its clocks at each wake-up."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, float, float, float]] = []
        self._stop = asyncio.Event()
        self._fd: int | None = None

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Sample until ``stop`` (the schedstat file is opened here: it names the thread that opens it)."""
        self._fd = fd = _schedstat_fd()
        samples = self._samples
        perf, thread_time, process_time = time.perf_counter, time.thread_time, time.process_time
        try:
            samples.append((perf(), thread_time(), _run_queue_s(fd), process_time()))
            while not self._stop.is_set():
                await asyncio.sleep(SLEEP_S)
                samples.append((perf(), thread_time(), _run_queue_s(fd), process_time()))
        finally:
            if fd is not None:
                os.close(fd)

    @property
    def lags_s(self) -> list[float]:
        """Each interval's lateness (wall time past ``SLEEP_S``), in order."""
        s = self._samples
        return [s[i][0] - s[i - 1][0] - SLEEP_S for i in range(1, len(s))]

    def summary(self) -> LagSummary:
        """The run's ``LagSummary``.

        Raises:
            ValueError: fewer than two wake-ups were recorded.
        """
        s = self._samples
        if len(s) < 2:
            raise ValueError("the probe recorded no interval")
        lags = self.lags_s
        worst = max(range(len(lags)), key=lags.__getitem__)
        parts = [self._parts(i) for i in range(len(lags))]
        cpu, queue, blocked = parts[worst]
        (w0, _, _, p0), (w1, _, _, p1) = s[worst], s[worst + 1]
        over = [i for i, lag in enumerate(lags) if lag > LAG_BUDGET_S]
        ordered = sorted(lags)
        return LagSummary(
            ordered[-1], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], len(lags), cpu, queue, blocked,
            (p1 - p0) / (w1 - w0), self._fd is not None, sum(lags[i] for i in over),
            sum(parts[i][0] for i in over), sum(parts[i][1] for i in over), sum(parts[i][2] for i in over))

    def _parts(self, i: int) -> tuple[float, float, float]:
        """Interval ``i``'s lateness as (cpu, run queue, blocked) seconds; a part over the lateness is cut to it."""
        (w0, c0, q0, _), (w1, c1, q1, _) = self._samples[i], self._samples[i + 1]
        lag = max(0.0, w1 - w0 - SLEEP_S)
        cpu = min(lag, c1 - c0)
        queue = min(lag - cpu, q1 - q0)
        return cpu, queue, lag - cpu - queue
