"""Loopback fake workers for gateway tests: a real aiohttp OpenAI server plus a real ZMQ KV event publisher.

A ``FakeWorker`` tokenizes exactly as the reference worker (``common.tokenization``), keeps a prefix cache of
full blocks keyed by chained hash, reports ``usage.prompt_tokens_details.cached_tokens`` with vLLM's last-token
rule, and publishes ``BlockStored`` for every newly cached block on an ephemeral PUB port.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web

from common.tokenization import encode_chat, encode_prompt, load_tokenizer, normalize_messages
from events.publisher import KVEventPublisher, PublisherConfig
from events.types import BlockStored, EngineBlockHash, Medium
from router.block_hash import hash_token_blocks

BLOCK_SIZE = 4


class FakeWorker:
    def __init__(self, worker_id: str, *, block_size: int = BLOCK_SIZE, with_events: bool = True) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.tokenizer, self.template = load_tokenizer(None)
        self.cached: set[int] = set()
        self.publisher = (
            KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", linger_s=0.0))
            if with_events else None
        )
        self.requests: list[dict] = []
        self.fail_statuses: list[int] = []
        self.stream_release: asyncio.Event | None = None
        self.answer_release: asyncio.Event | None = None
        self.eof_release: asyncio.Event | None = None  # set: the stream's end waits for it after [DONE]
        self.stream_cut: bytes | None = None
        """When set, a stream answers these bytes after its headers, then its connection is aborted."""
        self.num_active = 0
        self.num_cancelled = 0
        self.on_request: Callable[[dict], None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        if self.publisher is None:
            return None
        return self.publisher.endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)  # a real worker takes prompts of many MB
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            self.publisher.close()

    def store(self, token_ids: list[int], medium: Medium = Medium.GPU) -> int:
        """Cache (and publish) every full block of ``token_ids``; returns how many blocks were new."""
        hashes = hash_token_blocks(token_ids, self.block_size)
        new = [i for i, h in enumerate(hashes) if h not in self.cached]
        if not new:
            return 0
        start = new[0]
        self.cached.update(hashes)
        if self.publisher is not None:
            parent = EngineBlockHash(hashes[start - 1]) if start else None
            self.publisher.publish([BlockStored(
                block_hashes=tuple(EngineBlockHash(h) for h in hashes[start:]), parent_block_hash=parent,
                token_ids=tuple(token_ids[start * self.block_size: len(hashes) * self.block_size]),
                block_size=self.block_size, medium=medium,
            )])
        return len(hashes) - start

    def cached_tokens(self, token_ids: list[int]) -> int:
        hashes = hash_token_blocks(token_ids, self.block_size)
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return min(n, (len(token_ids) - 1) // self.block_size) * self.block_size

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ids = encode_prompt(self.tokenizer, prompt if isinstance(prompt, str) else list(prompt))
        return await self._serve(request, body, ids, "text_completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = encode_chat(self.tokenizer, self.template, normalize_messages(body["messages"]))
        return await self._serve(request, body, ids, "chat.completion")

    async def _serve(self, request: web.Request, body: dict, ids: list[int], obj: str) -> web.StreamResponse:
        self.requests.append({"body": body, "headers": dict(request.headers), "num_tokens": len(ids)})
        if self.fail_statuses:
            status = self.fail_statuses.pop(0)
            return web.json_response({"error": {"message": "boom"}}, status=status)
        cached = self.cached_tokens(ids)
        self.store(ids)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": obj, "model": body["model"], "worker": self.worker_id,
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self.num_active += 1
        try:
            if self.answer_release is not None:
                await self.answer_release.wait()
            await resp.prepare(request)
            if self.stream_cut is not None:
                await resp.write(self.stream_cut)
                assert request.transport is not None
                request.transport.abort()
                return resp
            for i in range(2):
                chunk = {"id": "x", "object": obj + ".chunk", "choices": [{"index": 0, "text": f"t{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0 and self.stream_release is not None:
                    await self.stream_release.wait()
            final = {"id": "x", "object": obj + ".chunk", "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            if self.eof_release is not None:
                await self.eof_release.wait()
            await resp.write_eof()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.num_active -= 1
        return resp
