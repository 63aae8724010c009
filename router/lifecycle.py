"""One request's lifecycle, from its admission slot to its settlement: ``RequestFlight``.

The path of a request, module by module::

    router.api._handle           read the body (size and time limits), ``parse_request`` (router.request_view:
                                 msgspec, routing fields only), the model's ``ModelTokenizer.view`` (incremental
                                 tokens and block hashes), an admission slot (router.admission); then
                                 ``RequestLifecycle.start`` hands the slot to the request's ``RequestFlight``
    RequestFlight.run            (this module) the steps below, then ``finish`` whatever happened
      router.routing.Router.route  the one entry for every policy: candidates (router.fleet), the request's
                                 ``IndexTicket`` matches the prompt in the model's index once, the policy decides
                                 (policies; under ``session_sticky`` the session owner is claimed through
                                 router.ownership), the ticket inserts the chosen worker's pending entries; returns
                                 the immutable ``RoutePlan``
      router.proxy.Proxy.forward   per attempt (best first, retried before the first byte): ``pre_request`` gives
                                 the attempt's ``WorkerLease`` (router.lease: in-flight counts, pending prefill
                                 tokens, the circuit breaker's verdict), router.transport sends it and the answer
                                 is relayed byte for byte; ``response_received`` when an answer is relayed,
                                 ``on_first_token`` at a stream's first chunk (the TTFT calibrator is fed here);
                                 every attempt releases its lease; returns the immutable ``ProxyOutcome``
      RequestFlight.finish         settles everything after the answer, once: the last lease released (again:
                                 harmless), the ticket withdraws the pending entries unless the chosen worker served
                                 the request (or moves them to the worker that served it after a retry), a
                                 ``session_sticky`` session moves to that worker (router.ownership), and the
                                 admission slot is given back
    router.api._handle           the response, or the outcome's error as OpenAI-style JSON (router.errors)

The hooks follow the request-control extension points of the Gateway API Inference Extension, which llm-d's
scheduler plugs into (``pkg/epp/requestcontrol/plugins.go``): PreRequest (``pre_request``), ResponseReceived
(``response_received``), the first ResponseStreaming (``on_first_token``), and ResponseComplete (``finish``), which
there too runs after a full answer or after a failure or disconnect.

A client that leaves (the handler is cancelled) ends the flight with an outcome built from what it saw: the worker
served the request only if its answer began (for a stream: its first chunk) before the client left; the session is
not moved for such a request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web

from router.admission import Admission
from router.config import ModelConfig
from router.decisions import outcome_name
from router.errors import GatewayError
from router.fleet import Fleet, WorkerRuntime
from router.lease import WorkerLease
from router.metrics import GatewayMetrics
from router.mismatch import MismatchCounter
from router.proxy import ClientHeaders, Proxy, ProxyOutcome
from router.request_view import ParsedRequest, PromptView
from router.routing import IndexTicket, RoutePlan, Router


class RequestLifecycle:
    """The parts every request's flight uses (one per gateway)."""

    __slots__ = ("router", "proxy", "fleet", "admission", "metrics", "max_inflight_per_worker", "_clock",
                 "mismatches")

    def __init__(
        self, router: Router, proxy: Proxy, fleet: Fleet, admission: Admission, metrics: GatewayMetrics,
        *, max_inflight_per_worker: int = 0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self.proxy = proxy
        self.fleet = fleet
        self.admission = admission
        self.metrics = metrics
        self.max_inflight_per_worker = max_inflight_per_worker
        self._clock = clock
        self.mismatches = MismatchCounter(router, metrics)

    def count_mismatch(self, worker_id: str, ticket: IndexTicket, predicted: int, reported: int) -> bool:
        """``MismatchCounter.count`` (``router.mismatch``): whether the ticket's journal stamp stays open."""
        return self.mismatches.count(worker_id, ticket, predicted, reported)

    def start(self, request_id: str) -> RequestFlight:
        """The flight of a request that holds an admission slot (its ``finish`` gives the slot back)."""
        return RequestFlight(self, request_id)

    def now_s(self) -> float:
        return self._clock()


class RequestFlight:
    """One admitted request: routed, forwarded, and finished exactly once (module docstring).

    Attributes:
        request_id: the request's id.
        plan: the routing decision, once made.
    """

    __slots__ = ("_lc", "request_id", "plan", "_lease", "_relayed_status", "_is_finished")

    def __init__(self, lifecycle: RequestLifecycle, request_id: str) -> None:
        self._lc = lifecycle
        self.request_id = request_id
        self.plan: RoutePlan | None = None
        self._lease: WorkerLease | None = None
        self._relayed_status: int | None = None
        self._is_finished = False

    async def run(
        self, request: web.Request, body: bytes, parsed: ParsedRequest, model: ModelConfig, view: PromptView,
        client_headers: ClientHeaders, *, received_at: float,
    ) -> ProxyOutcome:
        """Route the request, forward it and finish: the outcome (its ``error`` when it could not be served).

        ``received_at`` is the handler's ``time.perf_counter()`` reading when the request arrived.

        Raises:
            asyncio.CancelledError: the client went away (the flight is finished first).
        """
        lc = self._lc
        policy_name = lc.router.holder.policy.name
        outcome: ProxyOutcome | None = None
        try:
            try:
                plan = self.plan = await lc.router.route(
                    self.request_id, parsed, model, view, client_headers.routing,
                    max_inflight_per_worker=lc.max_inflight_per_worker)
            except GatewayError as exc:
                outcome = ProxyOutcome(None, None, None, exc)
                return outcome
            lc.metrics.decision_s.observe(time.perf_counter() - received_at)
            lc.metrics.count_decision(policy_name, plan.decision.reason)
            outcome = await lc.proxy.forward(request, body, plan, self, is_stream=parsed.is_stream,
                                             request_id=self.request_id, policy_name=policy_name,
                                             received_at=received_at, client_headers=client_headers)
            return outcome
        except asyncio.CancelledError:
            outcome = self.unfinished(is_client_gone=True)
            raise
        finally:
            await self.finish(outcome if outcome is not None else self.unfinished(is_client_gone=False))

    # -- the proxy's hooks (router.proxy.AttemptHooks) ------------------------------------------------------

    def pre_request(self, worker: WorkerRuntime, num_uncached_tokens: int) -> WorkerLease:
        """The lease of an attempt on ``worker`` (its ``num_uncached_tokens`` are pending prefill)."""
        plan = self.plan
        num_prompt_tokens = plan.num_prompt_tokens if plan is not None else 0
        lease = WorkerLease.acquire(worker, self._lc.metrics.worker(worker.worker_id), num_prompt_tokens,
                                    num_uncached_tokens, self._lc.now_s())
        self._lease = lease
        self._relayed_status = None
        return lease

    def response_received(self, lease: WorkerLease, status: int) -> None:
        """The answer of ``lease``'s worker, with ``status``, is being relayed (no retry after this)."""
        self._relayed_status = status

    def on_first_token(self, lease: WorkerLease, ttft_s: float) -> None:
        """A stream's first chunk: its TTFT calibrates the policy that decided the request, when that policy
        predicted it for this worker (``Decision.scores`` are predicted TTFTs in seconds)."""
        plan = self.plan
        if plan is None:
            return
        calibrator = plan.calibrator  # the policy that made the prediction, even if another is live now
        worker_id = lease.worker.worker_id
        if calibrator is not None and worker_id == plan.decision.worker_id:
            predicted_ttft_s = plan.decision.scores.get(worker_id)
            if predicted_ttft_s is not None:
                calibrator.observe(worker_id, predicted_ttft_s, ttft_s, speed_factor_used=plan.speed_factor_used)

    # -- the end -------------------------------------------------------------------------------------------

    def unfinished(self, *, is_client_gone: bool) -> ProxyOutcome:
        """The outcome of a flight cut short (the client left, or an unexpected error): the last attempt's worker
        served it only if its answer began."""
        lease = self._lease
        if lease is None or not lease.has_first_byte:
            return ProxyOutcome(None, None, None, is_client_gone=is_client_gone)
        return ProxyOutcome(None, lease.worker, self._relayed_status, has_client_bytes=True,
                            is_client_gone=is_client_gone, reported_cached_tokens=lease.reported_cached_tokens)

    async def finish(self, outcome: ProxyOutcome) -> None:
        """Settle the request after its answer (module docstring); a second call does nothing."""
        if self._is_finished:
            return
        self._is_finished = True
        lc = self._lc
        try:
            if self._lease is not None:
                self._lease.release()  # released by the proxy already on every path; a second release is a no-op
            plan = self.plan
            if plan is None:
                return
            served = outcome.served_by
            status = outcome.status
            reported = outcome.reported_cached_tokens
            is_confirming = False
            if served is not None and reported is not None:
                predicted = plan.predicted_cached_tokens.get(served.worker_id, 0)
                if predicted != reported and plan.ticket is not None:  # the cause, before settle changes the index
                    is_confirming = lc.count_mismatch(served.worker_id, plan.ticket, predicted, reported)
            if plan.ticket is not None:
                plan.ticket.settle(plan.chosen, served, outcome.is_ok, lc.now_s(), keep_window=is_confirming)
            lc.router.recent.settle(self.request_id, served.worker_id if served is not None else None, reported,
                                    outcome_name(outcome))
            key = plan.session_key
            chosen_id = plan.chosen.worker_id
            if (plan.is_session_sticky and key is not None and served is not None and not outcome.is_client_gone
                    and served.worker_id != chosen_id and status is not None and status < 500 and outcome.error is None
                    and served.worker_id in lc.fleet.workers):
                await lc.router.ownership.follow_retry(key, chosen_id, served.worker_id)
        finally:
            lc.admission.release()


