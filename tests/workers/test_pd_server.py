"""Prefill and decode workers over real HTTP on loopback, driven by the official openai client: vLLM's
``kv_transfer_params`` flow and SGLang's bootstrap flow, decode refusal at the bound, a transfer that times out,
and the roles' refusals."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from common.pd_protocol import BootstrapFields, bootstrap_body, decode_leg_body, prefill_leg_body
from tests.ports import free_port
from tests.workers.conftest import make_config
from workers.config import build_config
from workers.errors import ConfigError

pytestmark = pytest.mark.integration

PROMPT = "abcdefghijklmnopqrstuvwxyz0123456789"  # 36 byte tokens: 9 blocks of 4


def pd_config(role: str, worker_id: str, **overrides: Any) -> Any:
    raw: dict[str, Any] = {"role": role, "worker-id": worker_id, "kv-transfer": {"abort-request-timeout-s": 30.0}}
    raw.update(overrides)
    return make_config(**raw)


async def load(base_url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(base_url + "/load") as r:
        data: dict[str, Any] = await r.json()
        return data


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)


async def test_vllm_flow_prefill_parks_then_decode_pulls_and_streams(start_worker):
    agg = await start_worker(pd_config("both", "agg"))
    pre = await start_worker(pd_config("prefill", "p0", **{"kv-cache": {"num-gpu-blocks": 64, "block-size": 4}}))
    dec = await start_worker(pd_config("decode", "d0"))
    c_agg, c_pre, c_dec = client(agg.base_url), client(pre.base_url), client(dec.base_url)
    try:
        want = await c_agg.completions.create(model="sim-model", prompt=PROMPT, max_tokens=6, seed=3)
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 6, "seed": 3, "stream": True}
        leg1 = prefill_leg_body(body)
        first = await c_pre.completions.create(
            model="sim-model",
            prompt=PROMPT,
            max_tokens=1,
            seed=3,
            extra_body={"kv_transfer_params": leg1["kv_transfer_params"]},
        )
        assert first.choices[0].finish_reason == "length" and first.choices[0].text == want.choices[0].text[:1]
        params = (first.model_extra or {})["kv_transfer_params"]
        port = int(pre.base_url.rsplit(":", 1)[1])
        assert params == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[0, 1, 2, 3, 4, 5, 6, 7, 8]],  # one list per KV cache group, as vLLM 0.32
            "remote_engine_id": "p0",
            "remote_request_id": first.id,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": first.usage.prompt_tokens if first.usage else None,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }
        held = await load(pre.base_url)
        assert held["role"] == "prefill"
        assert held["kv_transfer"]["num_parked_requests"] == 1 and held["kv_transfer"]["num_parked_blocks"] == 9
        assert held["num_free_blocks"]["GPU"] == 64 - 9
        leg2 = decode_leg_body(body, params)
        text = ""
        stream = await c_dec.completions.create(
            model="sim-model",
            prompt=PROMPT,
            max_tokens=6,
            seed=3,
            stream=True,
            extra_body={"kv_transfer_params": leg2["kv_transfer_params"]},
        )
        async for chunk in stream:
            text += chunk.choices[0].text
        assert text == want.choices[0].text
        after = await load(pre.base_url)
        assert after["kv_transfer"]["num_parked_requests"] == 0 and after["kv_transfer"]["num_served_transfers"] == 1
        assert after["num_free_blocks"]["GPU"] == 64 and after["num_gpu_cached_blocks"] == 9
        d = await load(dec.base_url)
        assert d["kv_transfer"]["num_pulled_transfers"] == 1 and d["kv_transfer"]["num_pulled_blocks"] == 9
        assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 0 and d["num_free_blocks"]["GPU"] == 64
        # the decode worker registered the 9 received blocks, then the one its decode filled (41 tokens computed)
        assert d["num_gpu_cached_blocks"] == 10
        # a late second pull of the same request finds nothing parked
        with pytest.raises(openai.APIStatusError) as err:
            await c_dec.completions.create(
                model="sim-model", prompt=PROMPT + "!", max_tokens=2, extra_body={"kv_transfer_params": params}
            )
        assert err.value.status_code == 502 and "no parked KV" in str(err.value.message)
        d = await load(dec.base_url)
        assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 0 and d["num_free_blocks"]["GPU"] == 64
        # the same prompt again, decoded on a fresh worker: like vLLM 0.32, the decode leg reports the prefill
        # side's hits (8 blocks of 4: a hit never covers the last prompt token), not its own (none: it pulled all 9)
        dec2 = await start_worker(pd_config("decode", "d1"))
        c_dec2 = client(dec2.base_url)
        again = await c_pre.completions.create(
            model="sim-model", prompt=PROMPT, max_tokens=1, seed=3,
            extra_body={"kv_transfer_params": leg1["kv_transfer_params"]},
        )
        params2 = (again.model_extra or {})["kv_transfer_params"]
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == params2["remote_prefill_cached_tokens"] == 32
        try:
            got = await c_dec2.completions.create(
                model="sim-model", prompt=PROMPT, max_tokens=6, seed=3, extra_body={"kv_transfer_params": params2}
            )
        finally:
            await c_dec2.close()
        assert got.choices[0].text == want.choices[0].text
        assert got.usage is not None and got.usage.prompt_tokens_details is not None
        assert got.usage.prompt_tokens_details.cached_tokens == 32
        assert (await load(dec2.base_url))["kv_transfer"]["num_pulled_blocks"] == 9
    finally:
        for c in (c_agg, c_pre, c_dec):
            await c.close()


async def test_sglang_flow_both_legs_at_once(start_worker):
    agg = await start_worker(pd_config("both", "agg"))
    pre = await start_worker(pd_config("prefill", "p0"))
    dec = await start_worker(pd_config("decode", "d0"))
    port = int(pre.base_url.rsplit(":", 1)[1])
    fields = BootstrapFields("127.0.0.1", port, 4242)
    body = bootstrap_body({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "seed": 5}, fields)
    extra = {k: body[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    c_agg, c_pre, c_dec = client(agg.base_url), client(pre.base_url), client(dec.base_url)
    msgs: Any = body["messages"]
    try:
        want = await c_agg.chat.completions.create(model="sim-model", messages=msgs, max_tokens=5, seed=5)
        # the decode leg starts first: its pull waits for the room
        decode_task = asyncio.create_task(
            c_dec.chat.completions.create(model="sim-model", messages=msgs, max_tokens=5, seed=5, extra_body=extra)
        )
        await asyncio.sleep(0.05)
        waiting = await load(dec.base_url)
        assert waiting["kv_transfer"]["num_receiving_requests"] == 1
        prefill = await c_pre.chat.completions.create(
            model="sim-model", messages=msgs, max_tokens=5, seed=5, extra_body=extra
        )
        got = await decode_task
        assert prefill.usage is not None and prefill.usage.completion_tokens == 1  # a prefill server stops at one
        assert got.choices[0].message.content == want.choices[0].message.content
        p = await load(pre.base_url)
        assert p["kv_transfer"]["num_parked_requests"] == 0 and p["kv_transfer"]["num_served_transfers"] == 1
    finally:
        for c in (c_agg, c_pre, c_dec):
            await c.close()


async def small_pair(start_worker: Any, receive_wait_s: float) -> tuple[Any, Any, int]:
    """A prefill worker and a decode worker of 12 four-token blocks whose pulls time out after 0.5 s; the prefill
    worker's port."""
    pre = await start_worker(pd_config("prefill", "p0"))
    dec = await start_worker(pd_config("decode", "d0", **{
        "kv-cache": {"num-gpu-blocks": 12, "block-size": 4},
        "kv-transfer": {"pull-timeout-s": 0.5, "receive-wait-s": receive_wait_s}}))
    return pre, dec, int(pre.base_url.rsplit(":", 1)[1])


async def test_decode_refuses_past_its_free_blocks_and_a_failed_pull_releases_them(start_worker):
    pre, dec, port = await small_pair(start_worker, receive_wait_s=0.0)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 1}
    c_dec = client(dec.base_url)
    try:
        # room 1 never gets a prefill: the pull waits, holding 9 of the 12 blocks
        held = asyncio.create_task(
            c_dec.completions.create(model="sim-model", prompt=PROMPT, max_tokens=2, extra_body=extra)
        )
        for _ in range(100):  # until the decode worker admitted the transfer (a busy host can take a while)
            d = await load(dec.base_url)
            if d["kv_transfer"]["num_receiving_requests"] == 1:
                break
            await asyncio.sleep(0.05)
        assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 9 and d["num_free_blocks"]["GPU"] == 3
        async with aiohttp.ClientSession() as s:
            body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2, **extra, "bootstrap_room": 2}
            async with s.post(dec.base_url + "/v1/completions", json=body) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                err = (await r.json())["error"]
        assert err["code"] == "kv_transfer_refused"
        assert "cannot reserve KV blocks for a 36-token prompt now (3 free blocks" in err["message"]
        with pytest.raises(openai.APIStatusError) as failed:
            await held
        assert failed.value.status_code == 504 and "timed out after 0.5 s" in str(failed.value.message)
        d = await load(dec.base_url)
        assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 0 and d["num_free_blocks"]["GPU"] == 12
        assert d["kv_transfer"]["num_refused_transfers"] == 1 and d["kv_transfer"]["num_failed_pulls"] == 1
    finally:
        await c_dec.close()


async def test_a_decode_leg_past_the_free_blocks_waits_for_them_instead_of_being_refused(start_worker):
    """As vLLM and SGLang queue a decode request until its blocks can be allocated: room 1 holds 9 of the 12 blocks
    until its pull times out (0.5 s); room 2's leg, sent meanwhile, waits, is admitted once they are free, and fails
    only by its own pull's timeout. Nothing was refused; every block is free at the end."""
    pre, dec, port = await small_pair(start_worker, receive_wait_s=5.0)
    c_dec = client(dec.base_url)
    try:
        legs = []
        for room in (1, 2):
            extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
            legs.append(asyncio.create_task(
                c_dec.completions.create(model="sim-model", prompt=PROMPT, max_tokens=2, extra_body=extra)))
            await asyncio.sleep(0.1)
        d = await load(dec.base_url)
        assert d["kv_transfer"]["num_receiving_requests"] == 1 and d["kv_transfer"]["num_refused_transfers"] == 0
        for leg in legs:
            with pytest.raises(openai.APIStatusError) as failed:
                await leg
            assert failed.value.status_code == 504 and "timed out after 0.5 s" in str(failed.value.message)
        d = await load(dec.base_url)
        assert d["kv_transfer"]["num_refused_transfers"] == 0 and d["kv_transfer"]["num_failed_pulls"] == 2
        assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 0 and d["num_free_blocks"]["GPU"] == 12
    finally:
        await c_dec.close()


async def test_an_unpulled_transfer_times_out_and_frees_the_prefill_blocks(start_worker):
    pre = await start_worker(pd_config("prefill", "p0", **{"kv-transfer": {"abort-request-timeout-s": 0.2}}))
    dec = await start_worker(pd_config("decode", "d0"))
    c_pre, c_dec = client(pre.base_url), client(dec.base_url)
    try:
        first = await c_pre.completions.create(
            model="sim-model", prompt=PROMPT, max_tokens=1, extra_body=prefill_leg_body({})
        )
        params = (first.model_extra or {})["kv_transfer_params"]
        assert (await load(pre.base_url))["kv_transfer"]["num_parked_blocks"] == 9
        await asyncio.sleep(0.4)
        p = await load(pre.base_url)
        assert p["kv_transfer"]["num_parked_blocks"] == 0 and p["kv_transfer"]["num_expired_transfers"] == 1
        assert p["num_free_blocks"]["GPU"] == 64
        with pytest.raises(openai.APIStatusError) as err:
            await c_dec.completions.create(
                model="sim-model", prompt=PROMPT, max_tokens=2, extra_body={"kv_transfer_params": params}
            )
        assert err.value.status_code == 502
        assert (await load(dec.base_url))["num_free_blocks"]["GPU"] == 64
    finally:
        await c_pre.close()
        await c_dec.close()


async def test_a_reset_between_runs_releases_transfers_nobody_pulled(start_worker):
    pre = await start_worker(pd_config("prefill", "p0", **{"kv-cache": {"num-gpu-blocks": 64, "block-size": 4}}))
    c_pre = client(pre.base_url)
    try:
        await c_pre.completions.create(model="sim-model", prompt=PROMPT, max_tokens=1, extra_body=prefill_leg_body({}))
        assert (await load(pre.base_url))["kv_transfer"]["num_parked_blocks"] == 9
        async with aiohttp.ClientSession() as s:
            async with s.post(pre.base_url + "/reset_prefix_cache") as r:
                assert r.status == 409  # the parked blocks are in use until the abort timeout (30 s here)
            async with s.post(pre.base_url + "/reset_prefix_cache", params={"release_parked": "yes"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "release_parked"
            async with s.post(pre.base_url + "/reset_prefix_cache", params={"release_parked": "true"}) as r:
                assert r.status == 200
        p = await load(pre.base_url)
        assert p["kv_transfer"]["num_parked_blocks"] == 0 and p["kv_transfer"]["num_expired_transfers"] == 0
        assert p["num_free_blocks"]["GPU"] == 64
    finally:
        await c_pre.close()


async def test_roles_refuse_the_legs_they_do_not_serve(start_worker):
    dec = await start_worker(pd_config("decode", "d0"))
    both = await start_worker(pd_config("both", "b0"))
    pre = await start_worker(pd_config("prefill", "p0"))
    async with aiohttp.ClientSession() as s:
        cases = [
            (dec, {"kv_transfer_params": {"do_remote_decode": True}}, "role 'decode'"),
            (both, {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 3}, "--role prefill"),
            (pre, {**prefill_leg_body({}), "stream": True}, "must not stream"),
        ]
        for w, extra, message in cases:
            body = {"model": "sim-model", "prompt": "abc", "max_tokens": 1, **extra}
            async with s.post(w.base_url + "/v1/completions", json=body) as r:
                assert r.status == 400
                assert message in (await r.json())["error"]["message"]
        # every role serves a plain request
        for w in (dec, both, pre):
            async with s.post(w.base_url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}) as r:
                assert r.status == 200 and "kv_transfer_params" not in await r.json()


@pytest.mark.parametrize(
    "answer", [b"{not json", b"[1, 2]", b'{"block_ids": "x", "block_size": 4, "num_tokens": 36, "kv_bytes": 0}']
)
async def test_a_prefill_side_answering_the_pull_with_junk_is_a_502_with_the_blocks_released(start_worker, answer):
    """A prefill side whose ``POST /kv/pull`` answers 200 with something that is not a transfer descriptor (not
    JSON, another JSON type, a field of the wrong type): the decode leg is the OpenAI-style 502
    ``kv_transfer_failed`` naming it, the pull counts as failed, and every reserved block is free again."""

    async def junk_pull(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    fake = web.Application()
    fake.router.add_post("/kv/pull", junk_pull)
    runner = web.AppRunner(fake, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    dec = await start_worker(pd_config("decode", "d0"))
    params = {"do_remote_prefill": True, "remote_block_ids": [[0]], "remote_engine_id": "p0",
              "remote_request_id": "r0", "remote_host": "127.0.0.1", "remote_port": port}
    try:
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2, "stream": stream,
                        "kv_transfer_params": params}
                async with s.post(dec.base_url + "/v1/completions", json=body) as r:
                    assert r.status == 502 and r.content_type == "application/json"
                    err = (await r.json())["error"]
                assert err["code"] == "kv_transfer_failed" and err["param"] == "kv_transfer_params"
                assert err["message"].startswith(
                    f"prefill worker http://127.0.0.1:{port} answered the pull with an invalid descriptor: ")
        d = await load(dec.base_url)
        assert d["kv_transfer"]["num_failed_pulls"] == 2 and d["kv_transfer"]["num_pulled_transfers"] == 0
        assert d["kv_transfer"]["num_receiving_requests"] == 0 and d["kv_transfer"]["num_reserved_transfer_blocks"] == 0
        assert d["num_free_blocks"]["GPU"] == 64 and d["num_running_requests"] == 0
    finally:
        await runner.cleanup()


async def test_a_pull_for_a_room_no_leg_can_name_is_a_400_at_once(start_worker):
    """Rooms are in ``[0, 2**63 - 1]`` (``mini_lb``'s draw; a leg's body refuses others): ``POST /kv/pull`` for a
    room outside it is a 400 at once, not a wait of ``pull-timeout-s`` in one of the ``max-pending-rooms`` slots."""
    pre = await start_worker(pd_config("prefill", "p0", **{"kv-transfer": {"pull-timeout-s": 30.0}}))
    async with aiohttp.ClientSession() as s:
        for room in (-1, 2**63):
            async with s.post(pre.base_url + "/kv/pull", json={"engine_id": "d0", "bootstrap_room": room}) as r:
                assert r.status == 400, await r.text()
                err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error" and "$.bootstrap_room" in err["message"]
    assert (await load(pre.base_url))["kv_transfer"]["num_waiting_pulls"] == 0


@pytest.mark.unit
def test_a_bad_receive_wait_is_refused_by_name():
    assert build_config({}).kv_transfer.receive_wait_s == 60.0
    assert build_config({"kv-transfer": {"receive-wait-s": 0}}).kv_transfer.receive_wait_s == 0.0
    for bad in (-1.0, float("nan"), float("inf"), 3601, "60s"):
        with pytest.raises(ConfigError, match=r"\$\.kv-transfer\.receive-wait-s"):
            build_config({"kv-transfer": {"receive-wait-s": bad}})
