"""The Endpoint Picker: a client that speaks ext_proc as Envoy does (the generated protos of ``xds-protos``, one
bidirectional ``Process`` stream per HTTP request, real gRPC on loopback) against ``kvgate serve``'s gateway with
``endpoint_picker:`` on, in front of loopback fake workers that publish real KV events.

Protocol checked: ``kubernetes-sigs/gateway-api-inference-extension`` ``docs/proposals/004-endpoint-picker-protocol``
(the ``x-gateway-destination-endpoint`` header and the same value under the ``envoy.lb`` dynamic metadata namespace,
the ``envoy.lb.subset_hint`` subset, 503 ``ImmediateResponse`` when no endpoint is usable)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2

from common.tokenization import encode_prompt, load_tokenizer
from router.epp import EPP, endpoint_of
from tests.router.fakes import BLOCK_SIZE, FakeWorker
from tests.router.harness import GatewayHarness, index_holds, make_config, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOKENIZER, _ = load_tokenizer(None)
PREFIX = "A" * 40  # 10 blocks of 4 byte-tokens


@pytest.fixture
async def workers():
    ws = [FakeWorker(f"w{i}") for i in range(3)]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        await w.stop()


class EnvoyStream:
    """One ``Process`` stream, driven message by message as Envoy's ext_proc filter does."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self._out: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self._call = stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (message := await self._out.get()) is not None:
            yield message

    def send(self, message: pb.ProcessingRequest) -> None:
        self._out.put_nowait(message)

    async def read(self) -> pb.ProcessingResponse:
        async with asyncio.timeout(5):
            return await self._call.read()

    async def close(self) -> None:
        self._out.put_nowait(None)
        async with asyncio.timeout(5):
            assert await self._call.read() == grpc.aio.EOF


def headers_message(path: str, extra: dict[str, str] | None = None, *, end_of_stream: bool = False,
                    subset: list[str] | None = None, body_mode: int | None = None) -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": path, ":authority": "gw.example", "content-type": "application/json",
             **(extra or {})}
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in pairs.items()]),
        end_of_stream=end_of_stream))
    if subset is not None:
        md = struct_pb2.Struct()
        md.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(md)
    if body_mode is not None:
        message.protocol_config.request_body_mode = body_mode
    return message


def body_message(chunk: bytes, *, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def picked(response: pb.ProcessingResponse) -> tuple[str, str]:
    """``(header value, envoy.lb metadata value)`` of an answer that carries the pick."""
    common = (response.request_headers.response if response.HasField("request_headers")
              else response.request_body.response)
    assert common.clear_route_cache
    [option] = common.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint"
    metadata = json_format.MessageToDict(response.dynamic_metadata)
    assert list(metadata) == ["envoy.lb"] and list(metadata["envoy.lb"]) == ["x-gateway-destination-endpoint"]
    return option.header.raw_value.decode(), metadata["envoy.lb"]["x-gateway-destination-endpoint"]


class EppHarness(GatewayHarness):
    async def __aenter__(self):
        await super().__aenter__()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.app[EPP].port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await super().__aexit__(*exc)

    async def pick_with_body(self, body: bytes, num_chunks: int, headers: dict[str, str] | None = None,
                             path: str = "/v1/completions") -> tuple[pb.ProcessingResponse, pb.ProcessingResponse]:
        """Headers, then the body in ``num_chunks`` chunks (full duplex streamed); the two answers; then the
        response as Envoy relays it, and the stream's end."""
        stream = EnvoyStream(self.stub)
        stream.send(headers_message(path, headers))
        size = -(-len(body) // num_chunks)
        chunks = [body[i:i + size] for i in range(0, len(body), size)]
        assert len(chunks) == num_chunks
        for i, chunk in enumerate(chunks):
            stream.send(body_message(chunk, end_of_stream=i == len(chunks) - 1))
        first = await stream.read()
        if first.HasField("immediate_response"):
            await stream.close()
            return first, first
        second = await stream.read()
        stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
        assert (await stream.read()).HasField("response_headers")
        stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"ok":1}', end_of_stream=True)))
        echoed = await stream.read()
        assert echoed.response_body.response.body_mutation.streamed_response.body == b'{"ok":1}'
        await stream.close()
        return first, second


def epp_config(workers, **overrides):
    return make_config(workers, endpoint_picker={"host": "127.0.0.1", "port": 0, **overrides})


async def hold(h: GatewayHarness, workers: list[FakeWorker], held: dict[str, int]) -> None:
    for w in workers:
        n = held.get(w.worker_id, 0)
        if n:
            w.store(encode_prompt(TOKENIZER, PREFIX[: n * BLOCK_SIZE]))
            await wait_until(index_holds(h.gw, w.worker_id, n))


@pytest.mark.parametrize(("held", "num_chunks", "expected"), [
    ({"w0": 2, "w1": 6, "w2": 4}, 1, "w1"),
    ({"w0": 8, "w1": 6}, 3, "w0"),
    ({"w2": 10}, 5, "w2"),
])
async def test_body_carrying_pick_equals_the_http_gateways(workers, held, num_chunks, expected):
    body = json.dumps({"model": "m", "prompt": PREFIX, "max_tokens": 2}).encode()
    async with EppHarness(epp_config(workers), workers=workers) as h:
        await hold(h, workers, held)
        endpoints = {endpoint_of(w): w.worker_id for w in h.gw.fleet.workers.values()}
        first, second = await h.pick_with_body(body, num_chunks)
        header, metadata = picked(first)
        assert header == metadata == workers[int(expected[1])].url.removeprefix("http://")
        assert endpoints[header] == expected
        # the whole body goes back to Envoy, unchanged, in one streamed answer
        assert second.request_body.response.body_mutation.streamed_response.body == body
        assert second.request_body.response.body_mutation.streamed_response.end_of_stream
        # the stream settled: nothing in flight
        assert all(w.num_inflight_requests == 0 for w in h.gw.fleet.workers.values())
        status, headers, answer = await h.post("/v1/completions", json.loads(body))
        assert status == 200, answer
        assert headers["x-kvgate-worker"] == endpoints[header]


async def test_chat_path_routes_as_chat(workers):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": PREFIX}]}).encode()
    async with EppHarness(epp_config(workers), workers=workers) as h:
        first, _ = await h.pick_with_body(body, 2, path="/v1/chat/completions")
        header, _ = picked(first)
        status, headers, _ = await h.post("/v1/chat/completions", json.loads(body))
        assert status == 200
        assert header == endpoint_of(h.gw.fleet.workers[headers["x-kvgate-worker"]])


async def test_header_only_request_gets_the_least_loaded_endpoint(workers):
    async with EppHarness(epp_config(workers), workers=workers) as h:
        h.gw.fleet.workers["w0"].num_inflight_requests = 3
        h.gw.fleet.workers["w1"].num_inflight_requests = 1
        h.gw.fleet.workers["w2"].num_inflight_requests = 2
        stream = EnvoyStream(h.stub)
        stream.send(headers_message("/v1/models", end_of_stream=True))
        header, metadata = picked(await stream.read())
        await stream.close()
        assert header == metadata == endpoint_of(h.gw.fleet.workers["w1"])
        for w in ("w0", "w1", "w2"):
            h.gw.fleet.workers[w].num_inflight_requests = 0


async def test_fallback_endpoints_follow_the_ranking(workers):
    body = json.dumps({"model": "m", "prompt": PREFIX}).encode()
    async with EppHarness(epp_config(workers, num_fallback_endpoints=2), workers=workers) as h:
        await hold(h, workers, {"w2": 8})
        first, _ = await h.pick_with_body(body, 2)
        header, metadata = picked(first)
        listed = header.split(",")
        assert header == metadata and len(listed) == 3 and len(set(listed)) == 3
        assert listed[0] == endpoint_of(h.gw.fleet.workers["w2"])
        assert set(listed) == {endpoint_of(w) for w in h.gw.fleet.workers.values()}


async def test_subset_restricts_the_pick(workers):
    body = json.dumps({"model": "m", "prompt": PREFIX}).encode()
    async with EppHarness(epp_config(workers), workers=workers) as h:
        await hold(h, workers, {"w2": 8})
        only_w0 = [endpoint_of(h.gw.fleet.workers["w0"])]
        stream = EnvoyStream(h.stub)
        stream.send(headers_message("/v1/completions", subset=only_w0))
        stream.send(body_message(body, end_of_stream=True))
        header, _ = picked(await stream.read())
        await stream.read()
        await stream.close()
        assert [header] == only_w0
        stream = EnvoyStream(h.stub)
        stream.send(headers_message("/v1/completions", subset=["10.9.9.9:8000"]))
        stream.send(body_message(body, end_of_stream=True))
        answer = await stream.read()
        await stream.close()
        assert answer.immediate_response.status.code == 503


async def test_no_usable_endpoint_is_503_and_a_bad_body_its_own_status(workers):
    body = json.dumps({"model": "m", "prompt": PREFIX}).encode()
    async with EppHarness(epp_config(workers), workers=workers) as h:
        first, _ = await h.pick_with_body(json.dumps({"model": "nope", "prompt": "x"}).encode(), 1)
        assert first.immediate_response.status.code == 404
        assert json.loads(first.immediate_response.body)["error"]["code"] == "model_not_found"
        first, _ = await h.pick_with_body(b"{not json", 1)
        assert first.immediate_response.status.code == 400
        for w in ("w0", "w1", "w2"):
            status, _ = await h.admin("POST", f"/admin/workers/{w}/drain")
            assert status == 200
        first, _ = await h.pick_with_body(body, 2)
        response = first.immediate_response
        assert response.status.code == 503
        assert [(o.header.key, o.header.raw_value) for o in response.headers.set_headers] == [
            ("content-type", b"application/json")]
        assert json.loads(response.body)["error"]["type"]
        stream = EnvoyStream(h.stub)
        stream.send(headers_message("/v1/models", end_of_stream=True))
        assert (await stream.read()).immediate_response.status.code == 503
        await stream.close()


async def test_buffered_body_mode_continues_headers_and_picks_on_the_body(workers):
    body = json.dumps({"model": "m", "prompt": PREFIX}).encode()
    async with EppHarness(epp_config(workers), workers=workers) as h:
        await hold(h, workers, {"w1": 8})
        stream = EnvoyStream(h.stub)
        stream.send(headers_message("/v1/completions",
                                    body_mode=processing_mode_pb2.ProcessingMode.BUFFERED))
        continued = await stream.read()
        assert continued.HasField("request_headers")
        assert not continued.request_headers.response.header_mutation.set_headers
        stream.send(body_message(body, end_of_stream=True))
        answer = await stream.read()
        assert answer.HasField("request_body")
        header, metadata = picked(answer)
        await stream.close()
        assert header == metadata == endpoint_of(h.gw.fleet.workers["w1"])
