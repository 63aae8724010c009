"""OpenTelemetry request traces: the exact spans, their parentage and attributes, read from the SDK's in-memory
exporter, for a request served by a loopback fake worker (whole body and stream), one that fails before routing,
and the default (tracing off: no tracer, the plain router)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from common.tokenization import encode_prompt, load_tokenizer
from router.app import build_app
from router.routing import Router
from router.tracing import TracedRouter
from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, index_holds, make_config, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOKENIZER, _ = load_tokenizer(None)
PREFIX = "A" * 40  # 10 blocks of 4 byte-tokens


class TracedHarness(GatewayHarness):
    def __init__(self, workers: list[FakeWorker], exporter: InMemorySpanExporter, **overrides: object) -> None:
        super().__init__(make_config(workers, **overrides), workers=workers)  # then the traced app replaces it
        self.app = build_app(make_config(workers, tracing={"enabled": True}, **overrides), span_exporter=exporter)
        self.runner = web.AppRunner(self.app, handler_cancellation=True)


def by_name(exporter: InMemorySpanExporter) -> dict[str, object]:
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert len(names) == len(set(names)), names
    return {s.name: s for s in spans}


@pytest.mark.parametrize("stream", [False, True])
async def test_spans_parentage_and_attributes(workers, stream):
    exporter = InMemorySpanExporter()
    async with TracedHarness(workers, exporter) as h:
        assert isinstance(h.gw.router, TracedRouter)
        workers[1].store(encode_prompt(TOKENIZER, PREFIX[:24]))
        await wait_until(index_holds(h.gw, "w1", 6))
        status, headers, body = await h.post(
            "/v1/completions", {"model": "m", "prompt": PREFIX, "max_tokens": 2, "stream": stream},
            headers={"x-request-id": "req-1",
                     "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        assert status == 200, body
        assert headers["x-kvgate-worker"] == "w1"
    spans = by_name(exporter)
    assert sorted(spans) == sorted(["kvgate.request", "parse", "tokenize", "match", "select", "proxy",
                                    "first_byte"])
    root = spans["kvgate.request"]
    assert root.kind == SpanKind.SERVER
    assert root.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c  # the client's traceparent
    assert root.parent.span_id == 0xb7ad6b7169203331
    for name in ("parse", "tokenize", "match", "select", "proxy"):
        assert spans[name].parent.span_id == root.context.span_id, name
        assert spans[name].context.trace_id == root.context.trace_id
    assert spans["first_byte"].parent.span_id == spans["proxy"].context.span_id
    assert dict(root.attributes) == {
        "kvgate.request_id": "req-1", "kvgate.model": "m", "kvgate.num_prompt_tokens": 40,
        "kvgate.worker_id": "w1", "kvgate.predicted_cached_tokens": 24, "kvgate.decision_reason": "min_ttft"}
    assert dict(spans["select"].attributes) == {
        "kvgate.worker_id": "w1", "kvgate.predicted_cached_tokens": 24, "kvgate.decision_reason": "min_ttft"}
    assert dict(spans["proxy"].attributes) == {"kvgate.served_by": "w1", "http.response.status_code": 200}
    for name in ("parse", "tokenize", "match", "first_byte"):
        assert not spans[name].attributes, name
    # phases in order, inside the request
    order = [spans[n] for n in ("parse", "tokenize", "match", "select")]
    for earlier, later in zip(order, order[1:], strict=False):
        assert earlier.end_time <= later.start_time
    assert root.start_time <= spans["parse"].start_time and spans["proxy"].end_time <= root.end_time
    assert spans["select"].end_time <= spans["proxy"].start_time == spans["first_byte"].start_time
    assert spans["first_byte"].end_time <= spans["proxy"].end_time
    assert root.status.status_code == StatusCode.UNSET


async def test_a_request_refused_before_routing_is_one_error_trace(workers):
    exporter = InMemorySpanExporter()
    async with TracedHarness(workers, exporter) as h:
        status, _, body = await h.post("/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404, body
    spans = by_name(exporter)
    assert sorted(spans) == ["kvgate.request", "parse"]
    root = spans["kvgate.request"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description == "UnknownModelError: the model 'nope' does not exist"
    assert root.parent is None
    assert json.loads(body)["error"]["code"] == "model_not_found"


async def test_no_worker_traces_match_but_no_decision(workers):
    exporter = InMemorySpanExporter()
    async with TracedHarness(workers, exporter) as h:
        for w in ("w0", "w1"):
            status, _ = await h.admin("POST", f"/admin/workers/{w}/drain")
            assert status == 200
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert status == 503, body
    spans = by_name(exporter)
    assert sorted(spans) == ["kvgate.request", "match", "parse", "tokenize"]
    assert spans["kvgate.request"].status.status_code == StatusCode.ERROR
    assert "kvgate.worker_id" not in spans["kvgate.request"].attributes


async def test_tracing_is_off_by_default(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        assert h.gw.tracer is None
        assert type(h.gw.router) is Router
        status, _, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX, "max_tokens": 2})
        assert status == 200, body
