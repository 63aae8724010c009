"""A decode leg waiting for free blocks (``kv-transfer.receive-wait-s``), over real HTTP on loopback: a client that
leaves while its leg waits holds nothing afterwards, many waiters are all admitted in turn, a prompt that can never
fit is refused at once, and a worker shut down while legs wait holds nothing after."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.ports import free_port
from tests.workers.test_pd_server import PROMPT, load, pd_config
from workers.server import build_app, build_worker

pytestmark = pytest.mark.integration


async def wait_pair(start_worker: Any, pull_timeout_s: float, receive_wait_s: float) -> tuple[Any, int]:
    """A prefill worker (whose rooms never get a prefill, so every pull times out) and a decode worker of 12
    four-token blocks; the decode worker and the prefill worker's port."""
    pre = await start_worker(pd_config("prefill", "p0"))
    dec = await start_worker(pd_config("decode", "d0", **{
        "kv-cache": {"num-gpu-blocks": 12, "block-size": 4},
        "kv-transfer": {"pull-timeout-s": pull_timeout_s, "receive-wait-s": receive_wait_s}}))
    return dec, int(pre.base_url.rsplit(":", 1)[1])


def leg_body(port: int, room: int) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": room}


async def post_leg(base_url: str, port: int, room: int) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(base_url + "/v1/completions", json=leg_body(port, room)) as r:
        return r.status, await r.json()


async def until_receiving(base_url: str, num: int) -> dict[str, Any]:
    for _ in range(200):
        d = await load(base_url)
        if d["kv_transfer"]["num_receiving_requests"] == num:
            return d
        await asyncio.sleep(0.02)
    raise AssertionError(f"never {num} receiving: {d['kv_transfer']}")


async def test_a_client_leaving_while_its_leg_waits_leaves_nothing_reserved(start_worker):
    """Room 1 holds 9 of the 12 blocks until its pull times out (1.5 s); room 2's leg waits, its client leaves. The
    wait ends with the handler: room 1's blocks, once free, are not taken by the gone leg, nothing was refused."""
    dec, port = await wait_pair(start_worker, pull_timeout_s=1.5, receive_wait_s=10.0)
    holder = asyncio.create_task(post_leg(dec.base_url, port, 1))
    await until_receiving(dec.base_url, 1)
    waiter = asyncio.create_task(post_leg(dec.base_url, port, 2))
    await asyncio.sleep(0.2)
    waiter.cancel()  # the client closes its connection while the leg waits
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0.1)
    d = await load(dec.base_url)
    assert d["kv_transfer"]["num_receiving_requests"] == 1 and d["kv_transfer"]["num_reserved_transfer_blocks"] == 9
    assert d["num_free_blocks"]["GPU"] == 3
    status, body = await holder
    assert status == 504 and "timed out after 1.5 s" in body["error"]["message"]
    await asyncio.sleep(0.2)  # a leaked waiter would reserve the freed blocks now
    d = await load(dec.base_url)
    assert d["kv_transfer"]["num_receiving_requests"] == 0 and d["kv_transfer"]["num_reserved_transfer_blocks"] == 0
    assert d["num_free_blocks"]["GPU"] == 12
    assert d["kv_transfer"]["num_refused_transfers"] == 0 and d["kv_transfer"]["num_failed_pulls"] == 1
    assert d["num_running_requests"] == 0 and d["num_waiting_requests"] == 0


async def test_many_waiting_legs_are_each_admitted_in_turn(start_worker):
    """Four legs of 9 blocks each on 12 blocks: one at a time holds them until its pull times out (0.3 s), the
    others wait (10 s); every one is admitted and fails by its own pull only, none refused."""
    dec, port = await wait_pair(start_worker, pull_timeout_s=0.3, receive_wait_s=10.0)
    legs = [asyncio.create_task(post_leg(dec.base_url, port, room)) for room in range(1, 5)]
    answers = await asyncio.wait_for(asyncio.gather(*legs), 8.0)
    assert [status for status, _ in answers] == [504] * 4
    assert all("timed out after 0.3 s" in body["error"]["message"] for _, body in answers)
    d = await load(dec.base_url)
    assert d["kv_transfer"]["num_refused_transfers"] == 0 and d["kv_transfer"]["num_failed_pulls"] == 4
    assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 0 and d["num_free_blocks"]["GPU"] == 12


async def test_a_leg_whose_prompt_can_never_fit_is_refused_at_once_not_after_the_wait(start_worker):
    """A 36-token prompt needs 10 four-token blocks (its first output token included), the decode worker has 8: a
    400 at once, as for any request (no wait of ``receive-wait-s``, nothing reserved, no transfer counted)."""
    pre = await start_worker(pd_config("prefill", "p0"))
    dec = await start_worker(pd_config("decode", "d0", **{
        "kv-cache": {"num-gpu-blocks": 8, "block-size": 4}, "kv-transfer": {"receive-wait-s": 30.0}}))
    port = int(pre.base_url.rsplit(":", 1)[1])
    status, body = await asyncio.wait_for(post_leg(dec.base_url, port, 1), 5.0)
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"] == "the prompt needs more KV blocks than the worker has (8)"
    d = await load(dec.base_url)
    assert d["kv_transfer"]["num_refused_transfers"] == 0 and d["kv_transfer"]["num_failed_pulls"] == 0
    assert d["kv_transfer"]["num_reserved_transfer_blocks"] == 0 and d["num_free_blocks"]["GPU"] == 8


@pytest.mark.parametrize(("pull_timeout_s", "shutdown_timeout_s", "want_first"), [
    (0.3, 10.0, 504),  # graceful: the holder's pull fails by its own timeout
    (10.0, 0.3, None),  # the shutdown's timeout cancels the holder's handler mid-pull
])
async def test_a_worker_shut_down_while_legs_wait_holds_nothing_after(
        start_worker, pull_timeout_s: float, shutdown_timeout_s: float, want_first: int | None) -> None:
    """The leg waiting for blocks is refused as the shutdown begins (503), not admitted during its grace period."""
    pre = await start_worker(pd_config("prefill", "p0"))
    port = int(pre.base_url.rsplit(":", 1)[1])
    worker = build_worker(pd_config("decode", "d0", **{
        "kv-cache": {"num-gpu-blocks": 12, "block-size": 4},
        "kv-transfer": {"pull-timeout-s": pull_timeout_s, "receive-wait-s": 20.0}}), None)
    runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    dec_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", dec_port).start()
    url = f"http://127.0.0.1:{dec_port}"
    legs = [asyncio.create_task(post_leg(url, port, 1))]
    await until_receiving(url, 1)
    legs.append(asyncio.create_task(post_leg(url, port, 2)))
    await asyncio.sleep(0.2)
    await asyncio.wait_for(runner.cleanup(), 5.0)
    first, second = await asyncio.gather(*legs, return_exceptions=True)
    if want_first is None:
        assert type(first) is aiohttp.ServerDisconnectedError
    else:
        assert isinstance(first, tuple) and first[0] == want_first
    assert isinstance(second, tuple) and second[0] == 503
    assert second[1]["error"]["code"] == "kv_transfer_refused"
    assert "now: the worker is shutting down" in second[1]["error"]["message"]
    sched = worker.core.scheduler
    assert (len(sched.receiving), sched.num_receiving_blocks, len(sched.requests)) == (0, 0, 0)
    assert worker.core.kv.gpu.num_free_blocks == 12
    assert worker.decode_handoff.num_refused == 1
