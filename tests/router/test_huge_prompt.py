"""A huge prompt never holds the gateway's event loop while it is prepared: a small request sent after it is
answered first (ordering, not timing). The huge prompt's tokenization is held in the tokenizer thread until the
small request has its answer; were the preparation on the event loop, the small request could not be served
meanwhile and the test fails. Completions and chats both (``router.request_view.ModelTokenizer.view_async``); the
speed figures are in ``python -m benchmarks huge_prompt``."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.api import OFF_LOOP_BODY_BYTES, OFF_LOOP_PLAN_CHARS, num_prompt_chars, parse_request_async
from router.request_view import OFF_LOOP_CHARS
from tests.router.harness import GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

HUGE_CHARS = 1_000_000
"""A 1 MB prompt (the harness's byte tokenizer: 1M tokens, 250K blocks of 4)."""


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_a_small_request_is_answered_while_a_huge_one_is_prepared(workers, kind):
    assert HUGE_CHARS > 10 * OFF_LOOP_CHARS
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        model = h.gw.tokenizers["m"]
        encode_many = model.encode_many
        entered, release = threading.Event(), threading.Event()

        def held_encode_many(texts):  # runs where the gateway tokenizes: a tokenizer thread for a long prompt
            if sum(map(len, texts)) >= HUGE_CHARS:
                entered.set()
                release.wait(30)
            return encode_many(texts)

        model.encode_many = held_encode_many
        lines = "".join(f"line {i} of a long document\n" for i in range(HUGE_CHARS // 20))[:HUGE_CHARS]
        if kind == "chat":
            path, huge = "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": lines}]}
        else:
            path, huge = "/v1/completions", {"model": "m", "prompt": lines}
        order: list[str] = []

        async def send(name: str, body: dict) -> int:
            status, _, _ = await h.post(path, {**body, "max_tokens": 1}, headers={"x-kvgate-worker": "w0"})
            order.append(name)
            return status

        huge_task = asyncio.create_task(send("huge", huge))
        async with asyncio.timeout(30):
            while not entered.is_set():  # the huge prompt is being tokenized now; the loop runs meanwhile
                await asyncio.sleep(0.01)
        small = {"model": "m", "prompt": "hello"} if kind == "completions" else {
            "model": "m", "messages": [{"role": "user", "content": "hello"}]}
        assert await send("small", small) == 200
        assert not huge_task.done() and order == ["small"]
        release.set()
        assert await huge_task == 200
        assert order == ["small", "huge"]
        assert [r["num_tokens"] >= HUGE_CHARS for r in workers[0].requests] == [False, True]
        assert h.gw.fleet.workers["w0"].num_inflight_requests == 0


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("step", ["parse", "plan"])
# aiohttp's client warns when the gateway relays a body over 1 MiB as bytes (it writes it in one call)
@pytest.mark.filterwarnings("ignore:Sending a large body directly with raw bytes:ResourceWarning")
async def test_a_huge_bodys_decode_and_plan_run_in_threads(workers, monkeypatch, kind, step):
    """A body over ``OFF_LOOP_BODY_BYTES`` is decoded, and a prompt over ``OFF_LOOP_PLAN_CHARS`` planned (the cache
    lookups, which hash and cut the whole text), outside the event loop's thread: held there, a small request sent
    after it is still answered first."""
    import router.api as api

    num_chars = OFF_LOOP_PLAN_CHARS + 4096
    assert num_chars > OFF_LOOP_BODY_BYTES
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        model = h.gw.tokenizers["m"]
        entered, release = threading.Event(), threading.Event()
        threads: list[int] = []
        names: list[str] = []

        def hold() -> None:
            threads.append(threading.get_ident())
            names.append(threading.current_thread().name)
            entered.set()
            release.wait(30)

        if step == "parse":
            parse = api.parse_request

            def held_parse(kind_: str, body: bytes):
                if len(body) > OFF_LOOP_BODY_BYTES:
                    hold()
                return parse(kind_, body)

            monkeypatch.setattr(api, "parse_request", held_parse)
        else:
            plan = model.plan

            def held_plan(parsed):
                if num_prompt_chars(parsed) > OFF_LOOP_PLAN_CHARS:
                    hold()
                return plan(parsed)

            model.plan = held_plan
        lines = "".join(f"line {i} of a long document\n" for i in range(num_chars // 20))[:num_chars]
        if kind == "chat":
            path, huge = "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": lines}]}
            small = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        else:
            path, huge = "/v1/completions", {"model": "m", "prompt": lines}
            small = {"model": "m", "prompt": "hello"}
        order: list[str] = []

        async def send(name: str, body: dict) -> int:
            raw = io.BytesIO(json.dumps({**body, "max_tokens": 1}).encode())  # aiohttp warns on bytes over 1 MiB
            status, _, _ = await h.post(path, None, raw=raw,  # type: ignore[arg-type]
                                        headers={"x-kvgate-worker": "w0", "Content-Type": "application/json"})
            order.append(name)
            return status

        huge_task = asyncio.create_task(send("huge", huge))
        async with asyncio.timeout(30):
            while not entered.is_set():
                await asyncio.sleep(0.01)
        assert await send("small", small) == 200
        assert not huge_task.done() and order == ["small"]
        release.set()
        assert await huge_task == 200
        assert order == ["small", "huge"]
        assert len(threads) == 1 and threads[0] != threading.get_ident()  # not the loop's thread
        assert names == ["parse_0" if step == "parse" else "tokenize-m_0"]  # the gateway's own parse thread
        assert [r["num_tokens"] for r in workers[0].requests][0] < 100
        assert workers[0].requests[1]["num_tokens"] >= num_chars


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_parse_request_async_decodes_as_parse_request(kind):
    """The same ``ParsedRequest`` on either side of the threshold; a small body is decoded on the loop's thread."""
    import router.request_view as request_view

    threads: list[int] = []
    executor = ThreadPoolExecutor(1, initializer=lambda: threads.append(threading.get_ident()))
    try:
        for num_chars in (1000, OFF_LOOP_BODY_BYTES + 1):
            text = "x" * num_chars
            body = (b'{"model": "m", "max_tokens": 3, "prompt": "%s"}' % text.encode() if kind == "completions" else
                    b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % text.encode())
            got = await parse_request_async(kind, body, executor)
            assert got == request_view.parse_request(kind, body)
            assert num_prompt_chars(got) == num_chars
            assert len(threads) == (num_chars > OFF_LOOP_BODY_BYTES)  # the executor's thread started for the long one
        with pytest.raises(request_view.InvalidJSONError):
            await parse_request_async(kind, b"{" + b" " * OFF_LOOP_BODY_BYTES, executor)
    finally:
        executor.shutdown()


async def test_the_parse_thread_stops_with_the_gateway(workers):
    async with GatewayHarness(make_config(workers[:1]), workers=workers[:1]) as h:
        executor = h.gw.parse_executor
        assert await asyncio.get_running_loop().run_in_executor(executor, threading.current_thread) is not None
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(int)
