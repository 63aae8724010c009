"""The Endpoint Picker (EPP) of the Gateway API Inference Extension: an Envoy ``ext_proc`` gRPC server that picks
the worker of each request with the gateway's own policies and index (``endpoint_picker:``; the ``epp`` extra).

Protocol: ``kubernetes-sigs/gateway-api-inference-extension``, ``docs/proposals/004-endpoint-picker-protocol``
(v1.0.0), over Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor.Process`` (the generated protos of the
``xds-protos`` package), one bidirectional stream per HTTP request. Field by field:

- Request headers (``ProcessingRequest.request_headers``): the ``:path`` names the kind (``/v1/chat/completions``
  is chat, anything else completions); the other headers are the routing headers (``x-session-id``,
  ``x-kvgate-worker``...). Values are read from ``HeaderValue.raw_value`` (Envoy's), else ``value``. A request
  whose headers end the stream (``end_of_stream``, no body) is answered at once: the least loaded usable worker
  of the fleet (no prompt to match).
- Request body: chunks (``HttpBody.body``) are buffered until ``end_of_stream``. The protocol's body mode is
  ``FULL_DUPLEX_STREAMED`` (the EPP "MUST support streaming mode"; also what a stream without
  ``protocol_config`` gets): nothing is answered until the body is complete, then the ``request_headers``
  answer carries the pick and a ``request_body`` answer gives the whole body back as one
  ``BodyMutation.streamed_response`` with ``end_of_stream``. Under ``BUFFERED`` (``protocol_config``) the headers
  are continued at once and the pick rides the ``request_body`` answer's ``header_mutation``.
- The pick ("Destination Endpoint"): the header ``x-gateway-destination-endpoint`` set to ``ip:port`` (the
  worker's ``url`` host and port), and the same value in ``ProcessingResponse.dynamic_metadata`` under the
  namespace ``envoy.lb`` (``metadata_namespace``), key ``x-gateway-destination-endpoint`` (never two different
  values). With ``num_fallback_endpoints`` the decision's next-ranked workers follow, comma separated (the proxy
  goes down the list). ``clear_route_cache`` is set so the route is recomputed with the header.
- Endpoint subset: ``metadata_context.filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-
  subset"]`` (a list of ``ip:port``) restricts the pick to those endpoints; none of them usable (or an empty list)
  is an ``ImmediateResponse`` 503.
- No usable endpoint (no worker serves the model, all draining or unhealthy): ``ImmediateResponse`` 503 with the
  gateway's OpenAI-style JSON error; a bad body (unreadable JSON, unknown model, no prompt) gets its own status
  (400, 404) the same way, as ``router.errors`` gives it.
- Response (``response_headers``, ``response_body``, trailers): continued unchanged (a full-duplex response body is
  streamed back chunk by chunk). ``x-gateway-destination-endpoint-served`` in ``metadata_context`` under
  ``envoy.lb`` ("Destination Endpoint Served") names the worker that served the request; the request's pending
  index entries are settled for it (``IndexTicket.settle``) and its in-flight count (``WorkerLease``) released
  when the stream ends.

The EPP runs inside ``kvgate serve`` next to the HTTP gateway (one cleanup context, ``epp_context``): the same
``Gateway`` (fleet, indexes fed by the KV event subscriber, policy, sessions), so a request picks the worker the
HTTP gateway would pick for it in the same index state. Pool endpoints come from the config's ``workers``, the
admin API, or ``discovery:`` watching the pods that the ``InferencePool``'s selector selects (the Helm chart sets
``discovery.label_selector`` from it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import grpc
import msgspec
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.api import parse_request_async
from router.epp_config import EndpointPickerConfig
from router.errors import GatewayError, InvalidFieldError, NoWorkerError, UnknownModelError
from router.fleet import WorkerRuntime
from router.gateway import GATEWAY, Gateway
from router.lease import WorkerLease
from router.request_view import RequestKind
from router.routing import RoutePlan

__all__ = ["DESTINATION_HEADER", "EPP", "SERVED_KEY", "SUBSET_KEY", "EndpointPicker", "endpoint_of", "epp_context"]

logger = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Header and dynamic metadata key of the picked endpoints (the protocol's "Destination Endpoint")."""
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""Filter metadata key of the data plane's endpoint subset."""
SERVED_KEY = "x-gateway-destination-endpoint-served"
"""Filter metadata key of the endpoint that served the request."""
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def endpoint_of(worker: WorkerRuntime) -> str:
    """The worker's ``ip:port`` (its ``url``'s host and port; 80 or 443 when the URL names none)."""
    parts = urlsplit(worker.config.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _metadata_value(request: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    md = request.metadata_context.filter_metadata
    if namespace not in md:
        return None
    fields = md[namespace].fields
    return fields[key] if key in fields else None


class _Exchange:
    """One HTTP request's stream: what arrived, the pick, and what is settled at its end."""

    __slots__ = ("headers", "subset", "chunks", "body_mode", "plan", "lease", "status", "served", "is_done")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.body_mode = _FULL_DUPLEX
        self.plan: RoutePlan | None = None
        self.lease: WorkerLease | None = None
        self.status: int | None = None
        self.served: WorkerRuntime | None = None
        self.is_done = False


class EndpointPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ext_proc service over a ``Gateway`` (module docstring).

    Attributes:
        port: the bound port, once ``start`` returned.
    """

    def __init__(self, gw: Gateway, config: EndpointPickerConfig) -> None:
        self._gw = gw
        self._config = config
        self._server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind ``host:port`` and serve.

        Raises:
            GatewayError: the address cannot be bound.
        """
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self, server)
        address = f"{self._config.host}:{self._config.port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise GatewayError(f"endpoint_picker: cannot bind {address}: {exc}") from exc
        await server.start()
        self._server = server
        logger.info("endpoint picker (ext_proc) listening on %s:%d", self._config.host, self.port)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (streams in progress get ``grace_s``)."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """The stream of one HTTP request (module docstring)."""
        ex = _Exchange()
        try:
            async for request in request_iterator:
                for response in await self._on_message(ex, request):
                    yield response
        finally:
            self._settle(ex)

    async def _on_message(self, ex: _Exchange, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        which = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            ex.body_mode = request.protocol_config.request_body_mode
        if which == "request_headers":
            ex.headers = _headers(request.request_headers)
            ex.subset = self._subset(request)
            if request.request_headers.end_of_stream:
                return [await self._pick(ex, None)]
            if ex.body_mode == _BUFFERED:  # headers continue now; the pick comes with the body's answer
                return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
            return []
        if which == "request_body":
            ex.chunks.append(request.request_body.body)
            if not request.request_body.end_of_stream:
                if ex.body_mode == _FULL_DUPLEX:
                    return []
                return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
            return await self._pick_with_body(ex, b"".join(ex.chunks))
        if which == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if which == "response_headers":
            self._on_response_headers(ex, request)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if which == "response_body":
            body = request.response_body
            if body.end_of_stream:
                self._settle(ex)
            if ex.body_mode == _FULL_DUPLEX:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body.body, end_of_stream=body.end_of_stream)))))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if which == "response_trailers":
            self._settle(ex)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _subset(self, request: pb.ProcessingRequest) -> list[str] | None:
        value = _metadata_value(request, self._config.subset_namespace, SUBSET_KEY)
        if value is None:
            return None
        if value.HasField("list_value"):
            return [v.string_value for v in value.list_value.values if v.string_value]
        return [s.strip() for s in value.string_value.split(",") if s.strip()]

    async def _pick_with_body(self, ex: _Exchange, body: bytes) -> list[pb.ProcessingResponse]:
        picked = await self._pick(ex, body)
        if picked.HasField("immediate_response"):
            return [picked]
        if ex.body_mode == _FULL_DUPLEX:
            return [picked, pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=body, end_of_stream=True)))))]
        common = picked.request_headers.response  # BUFFERED: the pick rides the body's answer
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                      dynamic_metadata=picked.dynamic_metadata)]

    async def _pick(self, ex: _Exchange, body: bytes | None) -> pb.ProcessingResponse:
        """The answer that carries the pick, or an ``ImmediateResponse`` with the error."""
        gw = self._gw
        subset = ex.subset
        try:
            if body is None:
                endpoints = self._least_loaded(subset)
            else:
                endpoints = await self._route(ex, body, subset)
        except GatewayError as exc:
            gw.metrics.rejected_total.labels(type(exc).__name__).inc()
            return _immediate(exc)
        value = ",".join(endpoints)
        metadata = struct_pb2.Struct()
        metadata.update({self._config.metadata_namespace: {DESTINATION_HEADER: value}})
        mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=value.encode()))])
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=mutation, clear_route_cache=True)),
            dynamic_metadata=metadata)

    def _usable(self, workers: Sequence[WorkerRuntime], subset: list[str] | None) -> list[WorkerRuntime]:
        allowed = set(subset) if subset is not None else None
        return [w for w in workers if w.is_healthy and not w.is_draining
                and (allowed is None or endpoint_of(w) in allowed)]

    def _least_loaded(self, subset: list[str] | None) -> list[str]:
        usable = self._usable(list(self._gw.fleet.workers.values()), subset)
        if not usable:
            raise NoWorkerError("no endpoint of the pool is usable", reason="no_usable_endpoint")
        usable.sort(key=lambda w: w.num_inflight_requests)
        return [endpoint_of(w) for w in usable[: 1 + self._config.num_fallback_endpoints]]

    async def _route(self, ex: _Exchange, body: bytes, subset: list[str] | None) -> list[str]:
        """Parse, tokenize and route as ``router.api`` does; the endpoints, the chosen one first.

        Raises:
            GatewayError: the request's error (bad body, unknown model, no usable worker).
        """
        gw = self._gw
        path = ex.headers.get(":path", "")
        kind: RequestKind = "chat" if path.split("?", 1)[0].endswith("/chat/completions") else "completions"
        parsed = await parse_request_async(kind, body, gw.parse_executor)
        model = gw.config.model(parsed.model)
        if model is None:
            raise UnknownModelError(f"the model {parsed.model!r} does not exist", param="model",
                                    code="model_not_found")
        view = await gw.tokenizers[model.name].view_async(parsed)
        if view.num_tokens == 0:
            raise InvalidFieldError("the prompt has no tokens", param="prompt")
        request_id = ex.headers.get("x-request-id") or gw.next_request_id()
        routing = {k: v for k, v in ex.headers.items() if not k.startswith(":")}
        plan = await gw.router.route(request_id, parsed, model, view, routing,
                                     max_inflight_per_worker=gw.config.admission.max_inflight_per_worker)
        ranked = [plan.chosen, *plan.fallbacks(len(plan.workers_by_id))]
        if subset is not None:
            ranked = self._usable(ranked, subset)
            if not ranked:
                if plan.ticket is not None:
                    plan.ticket.settle(plan.chosen, None, False, gw.clock())
                raise NoWorkerError("no endpoint of the subset is usable", reason="no_usable_endpoint")
        primary = ranked[0]
        ex.plan = plan
        predicted = plan.predicted_cached_tokens.get(primary.worker_id, 0)
        ex.lease = WorkerLease.acquire(primary, gw.metrics.worker(primary.worker_id), plan.num_prompt_tokens,
                                       max(0, plan.num_prompt_tokens - predicted), gw.clock())
        gw.metrics.count_decision(gw.holder.policy.name, plan.decision.reason)
        return [endpoint_of(w) for w in ranked[: 1 + self._config.num_fallback_endpoints]]

    def _on_response_headers(self, ex: _Exchange, request: pb.ProcessingRequest) -> None:
        headers = _headers(request.response_headers)
        try:
            ex.status = int(headers.get(":status", ""))
        except ValueError:
            ex.status = None
        served = _metadata_value(request, self._config.metadata_namespace, SERVED_KEY)
        if served is not None and served.string_value:
            ex.served = next((w for w in self._gw.fleet.workers.values() if endpoint_of(w) == served.string_value),
                             None)
        elif ex.lease is not None:
            ex.served = ex.lease.worker
        if ex.lease is not None:
            ex.lease.on_first_byte(self._gw.clock())

    def _settle(self, ex: _Exchange) -> None:
        """The request's end (its response, or the stream closing): lease released, index ticket settled."""
        if ex.is_done:
            return
        ex.is_done = True
        if ex.lease is not None:
            ex.lease.release()
        plan = ex.plan
        if plan is not None and plan.ticket is not None:
            is_ok = ex.status is not None and ex.status < 400
            plan.ticket.settle(plan.chosen, ex.served, is_ok, self._gw.clock())


def _immediate(exc: GatewayError) -> pb.ProcessingResponse:
    """``ImmediateResponse`` with the error's status and its OpenAI-style JSON body."""
    body = msgspec.json.encode({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                                          "code": exc.code}})
    headers = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status), headers=headers, body=body,
        details=type(exc).__name__))


EPP = web.AppKey("endpoint_picker", EndpointPicker)
"""The app's ``EndpointPicker`` while it runs (``epp_context``)."""


async def epp_context(app: web.Application) -> AsyncIterator[None]:
    """The ext_proc server: started after the workers and loops (the index is being fed); stopped first."""
    gw = app[GATEWAY]
    config = gw.config.endpoint_picker
    assert config is not None
    picker = EndpointPicker(gw, config)
    await picker.start()
    app[EPP] = picker
    try:
        yield
    finally:
        await picker.stop()


