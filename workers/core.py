"""The engine core: runs the schedule -> execute -> update loop and hands results to request streams.

One asyncio task (``EngineCore.run``) per worker. It sleeps when idle (no CPU), and paces steps by the
engine's step duration times ``time_scale`` against a wall-clock anchor, so simulated time tracks wall time
without drift. A step's sampled tokens and KV events are handed out when the step ends, after its paced sleep
(a prefill's first token reaches the client one prefill later, as on a real engine). KV events produced by a
step are published once per step (one batch), as vLLM does. Shared pool reads and puts run on the pool's I/O
threads (``workers.kv.pool_tier``), not inside a step; a finished one wakes the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from events.publisher import KVEventPublisher
from events.types import KVEvent
from workers.engines.base import Engine
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, RequestOutput, Scheduler

logger = logging.getLogger(__name__)


class RequestStream:
    """Outputs of one request, consumed by its HTTP handler."""

    __slots__ = ("queue", "request")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()


class EngineCore:
    """Owns the scheduler, the KV manager, the engine and the event publisher."""

    def __init__(
        self,
        scheduler: Scheduler,
        engine: Engine,
        publisher: KVEventPublisher | None = None,
        time_scale: float = 1.0,
    ) -> None:
        """Wire the parts.

        Args:
            scheduler: the scheduler (with its KV manager).
            engine: executes steps.
            publisher: where KV events go, or ``None`` (events are dropped after each step).
            time_scale: wall seconds per simulated second (0: no pacing).
        """
        self.scheduler = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.engine = engine
        self.publisher = publisher
        self.time_scale = time_scale
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._freed = asyncio.Event()
        """Set after a step that finished a request or freed GPU blocks (a finished store's hold included), and by
        ``finish_request``: what ``add_receiving_within`` waits for."""
        self._num_free_blocks = 0
        self.is_closing = False
        """The worker is shutting down: ``add_receiving_within`` waits no more (``stop_receiving``)."""
        self.num_steps = 0
        self.last_published_seq = -1
        self.num_events_published = 0

    def add_request(self, request: Request) -> RequestStream:
        """Queue ``request``; its outputs arrive on the returned stream."""
        stream = RequestStream(request)
        self.scheduler.add_request(request)
        self._streams[request.request_id] = stream
        self._wakeup.set()
        return stream

    def add_receiving(self, request: Request) -> RequestStream | None:
        """Admit a decode-side request whose prompt KV a remote worker holds (``Scheduler.add_receiving``).

        Returns:
            Its stream, or ``None`` when the blocks cannot be reserved now (the transfer is refused).
        """
        if not self.scheduler.add_receiving(request):
            return None
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        return stream

    async def add_receiving_within(self, request: Request, wait_s: float) -> RequestStream | None:
        """``add_receiving``, tried again each time a request finishes, for at most ``wait_s`` seconds (wall).

        Returns:
            Its stream, or ``None`` when the blocks could not be reserved within ``wait_s`` or the worker began
            shutting down (``stop_receiving``) meanwhile (nothing is held).
        """
        stream = self.add_receiving(request)
        if stream is not None or wait_s <= 0 or self.is_closing:
            return stream
        freed = self._freed
        try:
            async with asyncio.timeout(wait_s):
                while stream is None:
                    freed.clear()
                    await freed.wait()
                    if self.is_closing:
                        return None
                    stream = self.add_receiving(request)
        except TimeoutError:
            return None
        return stream

    def stop_receiving(self) -> None:
        """The worker is shutting down: every decode leg still waiting for blocks (``add_receiving_within``) is
        refused now, and later ones at once, rather than admitted during the shutdown's grace period."""
        self.is_closing = True
        self._freed.set()

    def finish_receiving(self, request_id: str) -> bool:
        """The request's KV landed: it runs from the next step (``Scheduler.finish_receiving``)."""
        ok = self.scheduler.finish_receiving(request_id)
        if ok:
            self._wakeup.set()
        return ok

    def release_transfer_reader(self, request_id: str) -> bool:
        """A parked request's KV was pulled, or the wait for it expired (``Scheduler.release_transfer_reader``)."""
        ok = self.scheduler.release_transfer_reader(request_id)
        if ok:
            self._wakeup.set()
        return ok

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        """Finish a request now (disconnect, stop string); its blocks are freed at once."""
        self._streams.pop(request_id, None)
        if self.scheduler.finish_request(request_id, reason):
            self._wakeup.set()
            self._freed.set()

    def flush_events(self) -> list[KVEvent]:
        """Publish pending KV events as one batch (if any) and return them."""
        events = self.kv.take_events()
        if events and self.publisher is not None:
            self.last_published_seq = self.publisher.publish(events)
            self.num_events_published += len(events)
        return events

    def step(self) -> float:
        """Run one step synchronously; returns its duration in (simulated) seconds (0: nothing could run)."""
        outputs, duration = self._compute()
        self._finish_step(outputs)
        return duration

    def _compute(self) -> tuple[Sequence[RequestOutput], float]:
        """Schedule and execute one step; its outputs and events are held until ``_finish_step``."""
        step = self.scheduler.schedule()
        result = self.engine.execute(step)
        outputs = self.scheduler.update(result)
        self.num_steps += 1
        return outputs, result.duration_s

    def _finish_step(self, outputs: Sequence[RequestOutput]) -> None:
        """The step has ended: hand its tokens to the request streams and publish its KV events."""
        self._dispatch(outputs)
        self.flush_events()
        num_free = self.kv.gpu.num_free_blocks
        if num_free > self._num_free_blocks or any(out.finish_reason is not None for out in outputs):
            self._freed.set()
        self._num_free_blocks = num_free

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(out)
            if out.finish_reason is not None:
                del streams[out.request_id]

    def is_busy(self) -> bool:
        """Whether the loop has work (requests or copies in flight)."""
        return self.scheduler.has_work() or self.engine.has_pending_copies()

    async def run(self) -> None:
        """The loop; cancel the task to stop it."""
        loop = asyncio.get_running_loop()
        wakeup = self._wakeup
        # a pool read or put done on an I/O thread (workers.kv.pool_tier) wakes an idle loop to apply it

        def wake() -> None:
            loop.call_soon_threadsafe(wakeup.set)

        self.kv.set_io_waker(wake)
        anchor_wall = time.monotonic()
        sim_since_anchor = 0.0
        while True:
            if not self.is_busy():
                self.flush_events()
                self._wakeup.clear()
                await self._wakeup.wait()
                anchor_wall = time.monotonic()
                sim_since_anchor = 0.0
            try:
                outputs, duration = self._compute()
            except Exception:
                logger.exception("engine step failed")
                raise
            if duration == 0.0 or self.time_scale <= 0:
                self._finish_step(outputs)
            if duration == 0.0 and not self.engine.has_pending_copies():
                # nothing could run (admission blocked): wait for a finish or a new request
                self._wakeup.clear()
                await self._wakeup.wait()
                anchor_wall = time.monotonic()
                sim_since_anchor = 0.0
                continue
            sim_since_anchor += duration
            if self.time_scale > 0 and duration > 0.0:
                # the step's tokens and events become visible when it ends (simulated time, paced to wall time)
                delay = anchor_wall + sim_since_anchor * self.time_scale - time.monotonic()
                await asyncio.sleep(max(0.0, delay))
                self._finish_step(outputs)
            else:
                await asyncio.sleep(0)
