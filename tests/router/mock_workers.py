"""``FakeWorker``s answered in memory through a ``MockTransport``: the same prefix cache, ``cached_tokens`` and
real ZMQ KV events as ``tests.router.fakes.FakeWorker``, without an HTTP server, for proxy tests that need no socket
to a worker.

A ``MockWorker`` keeps ``FakeWorker``'s knobs: ``fail_statuses`` (answered in turn before any caching),
``answer_release`` (awaited before the headers), ``stream_release`` (awaited after a stream's first chunk), and
``stop()`` (every later request is refused before the first byte, as a closed port would be).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence

from common.tokenization import encode_chat, encode_prompt, normalize_messages
from router.config import GatewayConfig
from router.errors import TransportConnectError
from router.transport import MockResponse, MockTransport, UpstreamRequest
from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness


class _Stream(MockResponse):
    """A stream of a ``MockWorker``: counted active while it is read, cancelled when released before its end."""

    def __init__(self, worker: MockWorker, chunks: Sequence[bytes | asyncio.Event]) -> None:
        super().__init__(200, {"Content-Type": "text/event-stream"}, chunks)
        self._worker = worker

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        worker = self._worker
        worker.num_active += 1
        try:
            async for chunk in super().iter_chunks():
                yield chunk
        except asyncio.CancelledError:
            worker.num_cancelled += 1
            raise
        finally:
            worker.num_active -= 1


class MockWorker(FakeWorker):
    """A ``FakeWorker`` that answers ``MockTransport`` requests (``answer``) instead of HTTP ones."""

    def __init__(self, worker_id: str, **kwargs: object) -> None:
        super().__init__(worker_id, **kwargs)  # type: ignore[arg-type]
        self.is_stopped = False

    @property
    def url(self) -> str:
        return f"http://mock-{self.worker_id}.invalid"

    async def start(self) -> None:
        self.is_stopped = False

    async def stop(self) -> None:
        self.is_stopped = True
        if self.publisher is not None:
            self.publisher.close()

    async def answer(self, request: UpstreamRequest) -> MockResponse:
        if self.is_stopped:
            raise TransportConnectError(f"worker {self.worker_id} unreachable: ClientConnectorError",
                                        worker_id=self.worker_id, endpoint=request.base_url + request.path,
                                        is_before_first_byte=True)
        if request.method == "GET":
            return MockResponse(200, {"Content-Type": "application/json"}, [b'{"ok": true}'])
        body = json.loads(request.body)
        if request.path.endswith("/chat/completions"):
            ids = encode_chat(self.tokenizer, self.template, normalize_messages(body["messages"]))
            obj = "chat.completion"
        else:
            prompt = body["prompt"]
            ids = encode_prompt(self.tokenizer, prompt if isinstance(prompt, str) else list(prompt))
            obj = "text_completion"
        self.requests.append({"body": body, "headers": dict(request.headers), "num_tokens": len(ids)})
        if self.fail_statuses:
            status = self.fail_statuses.pop(0)
            return MockResponse(status, {"Content-Type": "application/json"}, [b'{"error": {"message": "boom"}}'])
        cached = self.cached_tokens(ids)
        self.store(ids)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if body.get("stream") and self.answer_release is not None:  # FakeWorker holds streams only
            self.num_active += 1
            try:
                await self.answer_release.wait()
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
            finally:
                self.num_active -= 1
        if not body.get("stream"):
            answer = {"id": "x", "object": obj, "model": body["model"], "worker": self.worker_id,
                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": usage}
            return MockResponse(200, {"Content-Type": "application/json"}, [json.dumps(answer).encode()])
        chunks: list[bytes | asyncio.Event] = []
        for i in range(2):
            chunk = {"id": "x", "object": obj + ".chunk", "choices": [{"index": 0, "text": f"t{i}"}]}
            chunks.append(f"data: {json.dumps(chunk)}\n\n".encode())
            if i == 0 and self.stream_release is not None:
                chunks.append(self.stream_release)
        final = {"id": "x", "object": obj + ".chunk", "choices": [], "usage": usage}
        chunks.append(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        return _Stream(self, chunks)


def mock_transport(workers: Sequence[MockWorker]) -> MockTransport:
    """A transport answering each worker's requests from its ``MockWorker`` (an unknown worker refuses them)."""
    by_id = {w.worker_id: w for w in workers}

    async def handle(request: UpstreamRequest) -> MockResponse:
        worker = by_id.get(request.worker_id)
        if worker is None:
            raise TransportConnectError(f"worker {request.worker_id} unreachable: ClientConnectorError",
                                        worker_id=request.worker_id, endpoint=request.base_url + request.path,
                                        is_before_first_byte=True)
        return await worker.answer(request)

    return MockTransport(handle)


class MockGatewayHarness(GatewayHarness):
    """``GatewayHarness`` whose workers are ``MockWorker``s behind one ``mock_transport``."""

    workers: list[MockWorker]

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic,
                 workers: Sequence[MockWorker] | None = None, reachable: Sequence[MockWorker] | None = None) -> None:
        """``reachable``: the workers the transport answers for (default ``workers``; a test adding a worker
        through the admin API names it here)."""
        workers = list(workers or [])
        super().__init__(config, clock, workers, transport=mock_transport(reachable or workers))
