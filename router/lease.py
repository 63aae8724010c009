"""Per-worker accounting of one attempt as a lease: ``WorkerLease.acquire`` when a request is sent to a worker,
``release`` on every exit (answer relayed, error, retry on another worker, client gone).

The lease is the only writer of a worker's in-flight counters and of its circuit breaker's verdicts on the request
path, as SGLang's radix cache pins a request's nodes with ``inc_lock_ref`` and unpins them with ``dec_lock_ref``
(``sglang/srt/mem_cache/radix_cache.py``) and vLLM's block pool takes blocks with ``touch`` and gives them back with
``free_blocks`` (``vllm/v1/core/block_pool.py``)::

    num_inflight_requests        +1 at acquire        -1 at release
    num_inflight_prompt_tokens   +prompt at acquire   -prompt at release
    num_pending_prefill_tokens   +uncached at acquire -uncached at the first byte (or at release)
    num_pending_prefill_token_pairs  +u * (2n - u) at acquire, -the same at the first byte (or at release):
                                 n**2 - k**2 for n prompt and k = n - u cached tokens, the attention work of the
                                 positions k..n (``policies/cost_model.py``)
    pending_prefills             the lease's (admitted_at_s, uncached, pairs) at acquire, removed at the first
                                 byte (or at release); times on the worker's clock, the gateway's clock over the
                                 worker's ``time_scale``, so the cost model drains the queue in the worker's seconds
    prefill_done_at_s            the first byte's time of the oldest pending request, on the worker's clock
    num_decoding_requests        +1 at the first byte -1 at the last byte (or at release)
    WorkerMetrics.num_inflight   +1 at acquire        -1 at release
    CircuitBreaker               on_attempt at acquire; one verdict (record_success / record_failure); a lease
                                 released without a verdict tells the breaker ``on_abandoned`` (a half-open trial
                                 whose client went away does not hold the circuit half-open). A 5xx is a failure
                                 at the headers; any other status waits for the body's end: success when the
                                 body came whole, failure when the worker broke it after its headers (so a
                                 worker that always fails after its headers opens its circuit)

Every step is idempotent: ``on_first_byte``, ``on_last_byte`` and ``release`` a second time change nothing, so
every exit path may release without knowing whether another already did.
"""

from __future__ import annotations

from router.fleet import WorkerRuntime
from router.metrics import WorkerMetrics


def uncached_token_pairs(num_prompt_tokens: int, num_uncached_tokens: int) -> int:
    """``n**2 - k**2`` for ``n`` prompt tokens of which ``u`` are uncached (``k = n - u``), i.e. ``u * (2n - u)``:
    the (query, key) pairs whose attention the prefill of positions ``k..n`` computes, up to the causal half
    (``policies/cost_model.py``). ``u`` is clamped to ``0..n``."""
    n = max(num_prompt_tokens, 0)
    u = min(max(num_uncached_tokens, 0), n)
    return u * (2 * n - u)


_SENT = 0
"""Sent, no byte back yet: the uncached prompt tokens are pending prefill."""
_DECODING = 1
"""The first byte came: the request is decoding."""
_ANSWERED = 2
"""The last byte came (or the answer was given up): nothing is pending or decoding."""
_RELEASED = 3


class WorkerLease:
    """One attempt's hold on a worker's counters and circuit breaker (see the module docstring).

    Attributes:
        worker: the worker.
        metrics: its ``WorkerMetrics``.
        num_prompt_tokens: the request's prompt tokens.
        num_uncached_tokens: prompt tokens the worker is predicted to prefill (pending until the first byte).
        has_first_byte: the worker's answer began (for a stream: its first chunk) while the lease was held.
        reported_cached_tokens: the cached tokens the relayed stream's usage reported, read when the relay ended
            however (a client that leaves after the usage chunk cancels the handler), or ``None``.
    """

    __slots__ = ("worker", "metrics", "num_prompt_tokens", "num_uncached_tokens", "num_uncached_token_pairs",
                 "has_first_byte", "reported_cached_tokens", "_stage", "_has_verdict")

    def __init__(self, worker: WorkerRuntime, metrics: WorkerMetrics, num_prompt_tokens: int,
                 num_uncached_tokens: int) -> None:
        """Use ``acquire`` (this only records the arguments)."""
        self.worker = worker
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.num_uncached_tokens = num_uncached_tokens
        self.num_uncached_token_pairs = uncached_token_pairs(num_prompt_tokens, num_uncached_tokens)
        self.has_first_byte = False
        self.reported_cached_tokens: int | None = None
        self._stage = _SENT
        self._has_verdict = False

    @classmethod
    def acquire(cls, worker: WorkerRuntime, metrics: WorkerMetrics, num_prompt_tokens: int,
                num_uncached_tokens: int, now_s: float) -> WorkerLease:
        """Count a request sent to ``worker`` at ``now_s`` (the gateway's monotonic clock, seconds; ``metrics`` is
        its ``WorkerMetrics``); half-open, it is the trial."""
        worker.num_inflight_requests += 1
        worker.num_inflight_prompt_tokens += num_prompt_tokens
        lease = cls(worker, metrics, num_prompt_tokens, num_uncached_tokens)
        worker.num_pending_prefill_tokens += num_uncached_tokens
        worker.num_pending_prefill_token_pairs += lease.num_uncached_token_pairs
        worker.pending_prefills[lease] = (now_s / worker.config.time_scale, num_uncached_tokens,
                                          lease.num_uncached_token_pairs)
        metrics.num_inflight += 1
        worker.breaker.on_attempt()
        return lease

    @property
    def is_released(self) -> bool:
        """``release`` was called."""
        return self._stage == _RELEASED

    def on_first_byte(self, now_s: float) -> None:
        """The worker's answer began at ``now_s`` (the gateway's clock): its pending prefill tokens are prefilled,
        the request decodes."""
        if self._stage == _SENT:
            worker = self.worker
            worker.num_pending_prefill_tokens -= self.num_uncached_tokens
            worker.num_pending_prefill_token_pairs -= self.num_uncached_token_pairs
            pending = worker.pending_prefills
            is_head = next(iter(pending), None) is self
            pending.pop(self, None)
            if is_head:  # the queue's head finished: nothing behind it was served before (a later one finishing
                # first was served beside it, and says nothing of the head's progress)
                done_at_s = now_s / worker.config.time_scale
                if done_at_s > worker.prefill_done_at_s:
                    worker.prefill_done_at_s = done_at_s
            worker.num_decoding_requests += 1
            self.has_first_byte = True
            self._stage = _DECODING

    def on_last_byte(self) -> None:
        """The worker's answer ended (or was given up): nothing of it is pending or decoding any more."""
        stage = self._stage
        if stage == _SENT:
            worker = self.worker
            worker.num_pending_prefill_tokens -= self.num_uncached_tokens
            worker.num_pending_prefill_token_pairs -= self.num_uncached_token_pairs
            worker.pending_prefills.pop(self, None)
            self._stage = _ANSWERED
        elif stage == _DECODING:
            self.worker.num_decoding_requests -= 1
            self._stage = _ANSWERED

    def record_success(self) -> None:
        """The worker answered with a status that is not a failure: its circuit closes (once per lease)."""
        if not self._has_verdict:
            self._has_verdict = True
            self.worker.breaker.record_success()

    def record_failure(self, now_s: float) -> None:
        """The attempt failed (connect error, timeout, 5xx) at ``now_s`` (monotonic seconds; once per lease)."""
        if not self._has_verdict:
            self._has_verdict = True
            self.worker.breaker.record_failure(now_s)

    def release(self) -> None:
        """Give everything back (see the module docstring). Harmless when called again."""
        if self._stage == _RELEASED:
            return
        self.on_last_byte()
        worker = self.worker
        worker.num_inflight_requests -= 1
        worker.num_inflight_prompt_tokens -= self.num_prompt_tokens
        self.metrics.num_inflight -= 1
        if not self._has_verdict:
            worker.breaker.on_abandoned()
        self._stage = _RELEASED
