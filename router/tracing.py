"""OpenTelemetry request traces (``tracing.enabled``; the ``otel`` extra): one trace per routed request.

Spans, each with the request's phases' own start and end times (recorded on the request path as
``time.perf_counter`` readings, turned into spans once the request is settled, so a phase costs one clock read)::

    kvgate.request        SERVER; the whole request, from its arrival to its settlement (router.lifecycle.finish)
      parse               body read and ``parse_request`` (router.api, router.request_view)
      tokenize            the model's incremental tokenizer and block hashes (``ModelTokenizer.view_async``)
      match               candidates, the index match and each candidate's predicted cached tokens
                          (``Router._inputs``)
      select              the policy's decision and the plan (``Router.route`` after the match)
      proxy               forwarding, retries included, until the answer is relayed (``Proxy.forward``)
        first_byte        from the first attempt's send to the served worker's first byte (for a stream: its
                          first chunk), the lease's ``has_first_byte`` moment

Attributes (``kvgate.`` names): on ``kvgate.request`` and ``select`` ``kvgate.worker_id`` (the decision's worker),
``kvgate.predicted_cached_tokens`` (its predicted cached prompt tokens), ``kvgate.decision_reason``; on
``kvgate.request`` also ``kvgate.request_id``, ``kvgate.model``, ``kvgate.num_prompt_tokens``; on ``proxy``
``kvgate.served_by`` and ``http.response.status_code`` (semantic conventions). A request that fails gets the
error's class and message as an ERROR status on ``kvgate.request``. A client's W3C ``traceparent`` header is the
parent of ``kvgate.request``.

With tracing off (the default) nothing here is imported: the gateway builds the plain ``Router`` and
``RequestLifecycle``, ``router.api`` checks ``gw.tracer is None`` and no span object is created.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.config import ModelConfig
from router.errors import GatewayError
from router.lease import WorkerLease
from router.lifecycle import RequestFlight, RequestLifecycle
from router.proxy import ClientHeaders, ProxyOutcome
from router.request_view import ParsedRequest, PromptView
from router.routing import RoutePlan, Router
from router.tracing_config import TracingConfig

__all__ = ["SPAN_NAMES", "RequestTrace", "RequestTracer", "TracedFlight", "TracedRouter"]

SPAN_NAMES = ("kvgate.request", "parse", "tokenize", "match", "select", "proxy", "first_byte")


class RequestTrace:
    """One request's phase times (``time.perf_counter`` seconds; ``0.0``: not reached) and its decision."""

    __slots__ = ("tracer", "parent", "received_at", "parsed_at", "tokenized_at", "route_started_at",
                 "matched_at", "routed_at", "proxy_ended_at", "first_byte_at", "plan", "request_id", "model",
                 "status", "served_by", "error", "_epoch_offset_ns", "_is_emitted")

    def __init__(self, tracer: RequestTracer, received_at: float, parent: otel_context.Context | None) -> None:
        self.tracer = tracer
        self.parent = parent
        self.received_at = received_at
        self.parsed_at = self.tokenized_at = self.route_started_at = self.matched_at = 0.0
        self.routed_at = self.proxy_ended_at = self.first_byte_at = 0.0
        self.plan: RoutePlan | None = None
        self.request_id = ""
        self.model = ""
        self.status: int | None = None
        self.served_by: str | None = None
        self.error: BaseException | None = None
        self._epoch_offset_ns = time.time_ns() - time.perf_counter_ns()
        self._is_emitted = False

    def parsed(self) -> None:
        """The body is read and parsed."""
        self.parsed_at = time.perf_counter()

    def tokenized(self) -> None:
        """The prompt view is built."""
        self.tokenized_at = time.perf_counter()

    def start_flight(self, lifecycle: RequestLifecycle, request_id: str) -> RequestFlight:
        """The request's flight (``RequestLifecycle.start``'s, traced): it emits this trace when settled."""
        return TracedFlight(lifecycle, request_id, self)

    def fail(self, exc: BaseException) -> None:
        """The request ends with ``exc`` before its flight (bad body, unknown model, admission): emitted now."""
        self.error = exc
        self.emit()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._epoch_offset_ns

    def emit(self) -> None:
        """Turn the recorded phases into spans and end them (once; phases not reached have no span)."""
        if self._is_emitted:
            return
        self._is_emitted = True
        tracer = self.tracer.tracer
        end_at = time.perf_counter()
        plan = self.plan
        attrs: dict[str, Any] = {"kvgate.request_id": self.request_id, "kvgate.model": self.model}
        decision_attrs: dict[str, Any] = {}
        if plan is not None:
            chosen = plan.chosen.worker_id
            decision_attrs = {"kvgate.worker_id": chosen,
                              "kvgate.predicted_cached_tokens": plan.predicted_cached_tokens.get(chosen, 0),
                              "kvgate.decision_reason": plan.decision.reason}
            attrs["kvgate.num_prompt_tokens"] = plan.num_prompt_tokens
            attrs.update(decision_attrs)
        root = tracer.start_span("kvgate.request", context=self.parent, kind=SpanKind.SERVER,
                                 start_time=self._ns(self.received_at), attributes=attrs)
        error = self.error
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        ctx = otel_trace.set_span_in_context(root)

        def child(name: str, start: float, end: float, attributes: Mapping[str, Any] | None = None,
                  parent: otel_context.Context = ctx) -> otel_trace.Span:
            span = tracer.start_span(name, context=parent, start_time=self._ns(start), attributes=attributes)
            span.end(end_time=self._ns(end))
            return span

        if self.parsed_at:
            child("parse", self.received_at, self.parsed_at)
        if self.tokenized_at:
            child("tokenize", self.parsed_at, self.tokenized_at)
        if self.matched_at:
            child("match", self.route_started_at, self.matched_at)
        if self.routed_at:
            child("select", self.matched_at, self.routed_at, decision_attrs)
        if self.routed_at and plan is not None:
            proxy_end = self.proxy_ended_at or end_at
            proxy_attrs: dict[str, Any] = {}
            if self.served_by is not None:
                proxy_attrs["kvgate.served_by"] = self.served_by
            if self.status is not None:
                proxy_attrs["http.response.status_code"] = self.status
            proxy = tracer.start_span("proxy", context=ctx, start_time=self._ns(self.routed_at),
                                      attributes=proxy_attrs)
            if self.first_byte_at:
                child("first_byte", self.routed_at, self.first_byte_at,
                      parent=otel_trace.set_span_in_context(proxy))
            proxy.end(end_time=self._ns(proxy_end))
        root.end(end_time=self._ns(end_at))


class RequestTracer:
    """The gateway's tracer (one per gateway; ``Gateway.tracer`` when ``tracing.enabled``).

    ``exporter`` replaces the OTLP exporter (tests pass the SDK's ``InMemorySpanExporter``; spans are then exported
    as each ends, not batched).
    """

    def __init__(self, config: TracingConfig, *, exporter: SpanExporter | None = None) -> None:
        self.config = config
        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=config.otlp_insecure)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvgate.router")
        self._propagator = TraceContextTextMapPropagator()
        self.current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
            "kvgate_request_trace", default=None)

    def begin(self, received_at: float, headers: Mapping[str, str]) -> RequestTrace:
        """The trace of a request that arrived at ``received_at`` (``time.perf_counter``) with ``headers``."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        return RequestTrace(self, received_at, parent)

    def shutdown(self) -> None:
        """Flush and stop the exporter."""
        self.provider.shutdown()


class TracedRouter(Router):
    """``Router`` that records, in the current request's trace, the route's start, the end of the match (the
    candidates and their predicted cached tokens, ``Router._inputs``) and the plan."""

    def __init__(self, *args: Any, tracer: RequestTracer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tracer = tracer

    def _inputs(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._inputs(*args, **kwargs)
        trace = self._tracer.current.get()
        if trace is not None:
            trace.matched_at = time.perf_counter()
        return result

    async def route(self, *args: Any, **kwargs: Any) -> RoutePlan:
        trace = self._tracer.current.get()
        if trace is None:
            return await super().route(*args, **kwargs)
        trace.route_started_at = time.perf_counter()
        plan = await super().route(*args, **kwargs)
        trace.routed_at = time.perf_counter()
        trace.plan = plan
        return plan


class TracedFlight(RequestFlight):
    """``RequestFlight`` that records its phases in ``trace`` (the current trace while it runs, for
    ``TracedRouter``) and emits it once settled."""

    __slots__ = ("trace", "_is_stream")

    def __init__(self, lifecycle: RequestLifecycle, request_id: str, trace: RequestTrace) -> None:
        super().__init__(lifecycle, request_id)
        self.trace = trace
        self._is_stream = False
        trace.request_id = request_id

    async def run(self, request: web.Request, body: bytes, parsed: ParsedRequest, model: ModelConfig,
                  view: PromptView, client_headers: ClientHeaders, *, received_at: float) -> ProxyOutcome:
        trace = self.trace
        trace.model = parsed.model
        self._is_stream = parsed.is_stream
        current = trace.tracer.current
        token = current.set(trace)
        try:
            return await super().run(request, body, parsed, model, view, client_headers, received_at=received_at)
        finally:
            current.reset(token)

    def response_received(self, lease: WorkerLease, status: int) -> None:
        super().response_received(lease, status)
        trace = self.trace
        trace.status = status
        trace.served_by = lease.worker.worker_id
        if not (self._is_stream and status == 200):  # a whole body: its first byte comes with the headers
            trace.first_byte_at = time.perf_counter()

    def on_first_token(self, lease: WorkerLease, ttft_s: float) -> None:
        self.trace.first_byte_at = time.perf_counter()
        super().on_first_token(lease, ttft_s)

    async def finish(self, outcome: ProxyOutcome) -> None:
        trace = self.trace
        if not trace.proxy_ended_at:
            trace.proxy_ended_at = time.perf_counter()
        if trace.error is None:
            if outcome.error is not None:
                trace.error = outcome.error
            elif outcome.status is not None and outcome.status >= 500:
                trace.error = GatewayError(f"the worker answered {outcome.status}")
        try:
            await super().finish(outcome)
        finally:
            trace.emit()
