"""A small OpenAI-compatible completions server on loopback for loadgen tests.

It streams ``max_tokens`` one-token chunks, reports ``usage`` with ``prompt_tokens`` = UTF-8 bytes of the prompt
and ``cached_tokens`` = the longest common prefix with any earlier prompt, rounded down to 16-token blocks (a
byte-level prefix cache), and names itself in the gateway's headers. Prompts starting with ``FAIL`` get a 503;
prompts longer than ``max_prompt_tokens`` get a 400, as a worker refuses a prompt its KV cache cannot hold. A
refused prompt is not cached. ``response_delay_s`` holds every answer back that long before its headers. Each
answer carries ``x-request-id: <worker_id>-req-<i>`` (``i``: the answered prompts before it), as the gateway sends
its id of the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

BLOCK_SIZE = 16


class FakeOpenAI:
    """State of the fake server: prompts seen and request headers received (``session_ids``: the ``x-session-id``
    of each answered request; ``headers``: every request's headers, lower-cased names, refused ones included)."""

    def __init__(
        self,
        worker_id: str = "fake-0",
        predicted_offset: int = 0,
        send_usage: bool = True,
        max_prompt_tokens: int | None = None,
        response_delay_s: float = 0.0,
    ) -> None:
        self.worker_id = worker_id
        self.predicted_offset = predicted_offset
        self.send_usage = send_usage
        self.max_prompt_tokens = max_prompt_tokens
        self.response_delay_s = response_delay_s
        self.prompts: list[bytes] = []
        self.session_ids: list[str | None] = []
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []

    def cached_tokens(self, prompt: bytes) -> int:
        best = 0
        for earlier in self.prompts:
            n = 0
            limit = min(len(earlier), len(prompt))
            while n < limit and earlier[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return (best // BLOCK_SIZE) * BLOCK_SIZE

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({name.lower(): value for name, value in request.headers.items()})
        prompt = body["prompt"].encode()
        if self.response_delay_s > 0:
            await asyncio.sleep(self.response_delay_s)
        if prompt.startswith(b"FAIL"):
            return web.Response(status=503, text="overloaded")
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            return web.Response(status=400, text=f"prompt of {len(prompt)} tokens > {self.max_prompt_tokens}")
        self.session_ids.append(request.headers.get("x-session-id"))
        cached = self.cached_tokens(prompt)
        self.prompts.append(prompt)
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-kvgate-worker": self.worker_id,
                "x-kvgate-predicted-cached-tokens": str(cached + self.predicted_offset),
                "x-request-id": f"{self.worker_id}-req-{len(self.prompts) - 1}",
            }
        )
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if self.send_usage:
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "total_tokens": len(prompt) + n,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serve_fake(state: FakeOpenAI) -> AsyncIterator[str]:
    """Run the fake server on 127.0.0.1 (free port); yields its base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", state.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
