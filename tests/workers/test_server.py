"""The worker over real HTTP on loopback: the official openai client, SSE framing, bad inputs, disconnects,
KV events over real ZMQ, snapshot, load, reset, tokenize, metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio

from common.tokenization import ByteTokenizer, DefaultChatTemplate, encode_chat, normalize_messages
from events.counters import EventCounters
from events.decode import EventDecoder
from events.types import AllBlocksCleared, BlockRemoved, BlockStored
from loadgen import client as loadgen_client
from tests.workers.conftest import make_config
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.server import ENGINE_TTFT_KEY

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def chat_ids(messages: list[dict[str, str]] = MESSAGES) -> list[int]:
    return encode_chat(ByteTokenizer(), DefaultChatTemplate(), normalize_messages(messages))


async def test_openai_client_chat_and_completions(start_worker):
    w = await start_worker()
    client = openai.AsyncOpenAI(base_url=w.base_url + "/v1", api_key="x", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        chat = await client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=5, seed=7)
        n = len(chat_ids())
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.prompt_tokens == n and chat.usage.completion_tokens == 5
        text = chat.choices[0].message.content
        assert text is not None and len(text) == 5 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
        # same seed, same output; second turn hits the cache per vLLM's rule
        again = await client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=5, seed=7)
        assert again.choices[0].message.content == text
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == 4 * ((n - 1) // 4)
        # streaming chat with usage
        pieces, usage = [], None
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            max_tokens=5,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == text
        assert usage is not None and usage.completion_tokens == 5 and usage.prompt_tokens == n
        # completions, non-stream and stream, with token-id prompts
        comp = await client.completions.create(model="sim-model", prompt="abcdefgh", max_tokens=3, seed=1)
        assert comp.choices[0].finish_reason == "length" and len(comp.choices[0].text) == 3
        comp_ids = await client.completions.create(model="sim-model", prompt=list(b"abcdefgh"), max_tokens=3, seed=1)
        assert comp_ids.choices[0].text == comp.choices[0].text
        assert comp_ids.usage is not None and comp_ids.usage.prompt_tokens_details is not None
        assert comp_ids.usage.prompt_tokens_details.cached_tokens == 4
        streamed = ""
        async for chunk in await client.completions.create(
            model="sim-model", prompt="abcdefgh", max_tokens=3, seed=1, stream=True
        ):
            streamed += chunk.choices[0].text
        assert streamed == comp.choices[0].text
    finally:
        await client.close()


async def test_sse_framing_is_vllm_shaped(start_worker):
    w = await start_worker()
    body = {
        "model": "sim-model",
        "prompt": "hi!",
        "max_tokens": 2,
        "stream": True,
        "seed": 3,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as s, s.post(w.base_url + "/v1/completions", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    payloads = [msgspec.json.decode(f[len(b"data: ") :]) for f in frames[:-2]]
    assert all(f.startswith(b"data: ") for f in frames[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]] == [None, None, "length"]
    assert all(p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 2
    # the engine's part of the TTFT, beside usage (workers.server.ENGINE_TTFT_KEY; the load generator's key)
    assert ENGINE_TTFT_KEY == loadgen_client.ENGINE_TTFT_KEY
    assert 0.0 <= payloads[-1][ENGINE_TTFT_KEY] < 5.0
    assert all(ENGINE_TTFT_KEY not in p for p in payloads[:-1])


async def test_stop_string_and_ignore_eos(start_worker):
    cfg = make_config(timing={"eos-probability": 1.0})
    w = await start_worker(cfg)
    async with aiohttp.ClientSession() as s:
        async with s.post(w.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}) as r:
            out = await r.json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
        body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
        async with s.post(w.base_url + "/v1/completions", json=body) as r:
            out = await r.json()
        # EOS is never appended as text; ignore_eos keeps going to max_tokens
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    w2 = await start_worker()
    async with aiohttp.ClientSession() as s:
        async with s.post(w2.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 12, "seed": 5}) as r:
            full = (await r.json())["choices"][0]["text"]
        stop = full[3:5]
        body = {"prompt": "x", "max_tokens": 12, "seed": 5, "stop": [stop]}
        async with s.post(w2.base_url + "/v1/completions", json=body) as r:
            out = await r.json()
    assert out["choices"][0]["text"] == full[: full.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert w2.worker.core.kv.gpu.num_free_blocks == 64


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": ""}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": -3}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "' + b"a" * 600 + b'"}', "prompt"),
        ("/v1/completions", b'{"prompt": "aaaa", "max_tokens": 510}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": "ten"}', None),
        ("/v1/completions", b'{"prompt": 5}', None),
        ("/v1/completions", b'{"prompt": [1, "a"]}', "prompt"),
        ("/v1/completions", b'{"prompt": [999999]}', "prompt"),
        ("/v1/completions", b'{"prompt": "a"', None),
        ("/v1/completions", b"", None),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', "messages"),
        ("/v1/chat/completions", b'{"messages": "hi"}', None),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
            "temperature",
        ),
    ],
)
async def test_bad_input_is_a_400_and_leaks_nothing(start_worker, path, body, param):
    w = await start_worker()
    async with aiohttp.ClientSession() as s:
        async with s.post(w.base_url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] == param
        async with s.post(w.base_url + "/v1/completions", json={"prompt": "still up", "max_tokens": 1}) as r:
            assert r.status == 200
    assert w.worker.core.kv.gpu.num_free_blocks == 64
    assert w.worker.core.scheduler.requests == {}


async def test_unknown_model_is_404(start_worker):
    w = await start_worker()
    async with aiohttp.ClientSession() as s:
        async with s.post(w.base_url + "/v1/completions", json={"model": "nope", "prompt": "a"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"


async def test_disconnect_mid_stream_frees_blocks(start_worker):
    w = await start_worker(make_config(**{"time-scale": 1.0}))
    core = w.worker.core
    body = {"prompt": "a" * 40, "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(w.base_url + "/v1/completions", json=body)
        await r.content.readline()  # the first chunk arrived: the request holds blocks
        assert core.kv.gpu.num_free_blocks < 64 and core.scheduler.num_running == 1
        r.close()
    for _ in range(200):
        if core.scheduler.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert core.scheduler.num_running == 0 and core.scheduler.requests == {}
    assert core.kv.gpu.num_free_blocks == 64


async def test_events_published_equal_blocks_cached_and_evicted(start_worker):
    cfg = make_config(**{"kv-cache": {"num-gpu-blocks": 8, "block-size": 4}})
    w = await start_worker(cfg, with_events=True)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(w.events_endpoint)
    decoder = EventDecoder(EventCounters())
    try:
        async with aiohttp.ClientSession() as s:
            # the SUB joins asynchronously: poll with a throwaway request until a batch arrives
            for _ in range(100):
                async with s.post(w.base_url + "/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 1}):
                    pass
                if await sub.poll(50):
                    break
            while await sub.poll(50):
                await sub.recv_multipart()
            async with s.post(w.base_url + "/reset_prefix_cache") as r:
                assert r.status == 200
            prompt_a = list(range(10, 23))  # 13 tokens: 3 full blocks; + 2 outputs = 15: still 3
            async with s.post(w.base_url + "/v1/completions", json={"prompt": prompt_a, "max_tokens": 2}):
                pass
            # 25 tokens need 7 of the 8 blocks: free queue is 4 unused, then a's blocks tail first (partial, 2, 1, 0)
            prompt_b = list(range(100, 125))
            async with s.post(w.base_url + "/v1/completions", json={"prompt": prompt_b, "max_tokens": 1}):
                pass
        received = []
        seqs = []
        while await sub.poll(200):
            topic, seq, payload = await sub.recv_multipart()
            batch = decoder.decode(payload, worker_id="w", seq=int.from_bytes(seq, "big"))
            assert batch is not None
            seqs.append(batch.seq)
            received.extend(batch.events)
    finally:
        sub.close(0)
        ctx.term()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    ha = [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(), prompt_a, 4)]
    hb = [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(), prompt_b, 4)]
    assert received[0] == AllBlocksCleared()
    assert received[1] == BlockStored(tuple(ha), None, tuple(prompt_a[:12]), 4)
    removed = [h for e in received if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored_b = [h for e in received[2:] if isinstance(e, BlockStored) for h in e.block_hashes]
    assert removed == [ha[2], ha[1]] and stored_b == hb
    assert all(len(e.block_hashes) == 1 for e in received if isinstance(e, BlockRemoved))


async def test_snapshot_load_tokenize_metrics(start_worker):
    w = await start_worker(with_events=True)
    async with aiohttp.ClientSession() as s:
        async with s.post(w.base_url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.get(w.base_url + "/kv/snapshot") as r:
            last_seq = int(r.headers["x-kvgate-last-seq"])
            batch = EventDecoder(EventCounters()).decode(await r.read(), worker_id="w", seq=0)
        async with s.get(w.base_url + "/load") as r:
            load = await r.json()
        async with s.post(w.base_url + "/tokenize", json={"messages": MESSAGES}) as r:
            tok = await r.json()
        async with s.get(w.base_url + "/metrics") as r:
            metrics_text = await r.text()
        async with s.get(w.base_url + "/health") as r:
            assert r.status == 200
    assert last_seq == w.worker.core.last_published_seq >= 0
    assert batch is not None and batch.events[0] == AllBlocksCleared()
    ids = chat_ids() + [0, 0]
    n_blocks = (len(chat_ids()) + 1) // 4  # prompt + 1 computed output token
    stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    expected = [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(), ids, 4)][:n_blocks]
    assert stored == expected
    assert load["num_running_requests"] == 0 and load["num_free_blocks"] == {"GPU": 64}
    assert load["worker_id"] == "w-test" and len(load["start_id"]) == 32
    assert tok["tokens"] == chat_ids() and tok["count"] == len(chat_ids())
    assert 'kvgate_worker_requests_total{finish_reason="length",worker_id="w-test"} 1.0' in metrics_text
