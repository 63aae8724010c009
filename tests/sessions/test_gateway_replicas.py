"""Two real gateway replicas sharing the Redis session store, in front of loopback fake workers.

The inner policy is round_robin, so without a shared store the replicas would send one session's turns to
different workers; every assertion below holds only because the replicas agree through Redis.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.app import build_app
from router.config import GatewayConfig, parse_config
from router.gateway import GATEWAY, Gateway

pytestmark = pytest.mark.integration

TOKEN = "test-admin-token"
STICKY = {"name": "session_sticky", "inner": {"name": "round_robin"}}


class Worker:
    """A loopback OpenAI completions server that names itself in every response."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.num_requests = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.num_requests += 1
        return web.json_response({
            "id": f"cmpl-{self.num_requests}", "object": "text_completion", "model": body["model"],
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                      "prompt_tokens_details": {"cached_tokens": 0}}})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class Replica:
    """One gateway replica on a loopback port."""

    def __init__(self, config: GatewayConfig) -> None:
        self.app = build_app(config)
        self.runner = web.AppRunner(self.app)
        self.url = ""
        self.http: aiohttp.ClientSession | None = None

    @property
    def gw(self) -> Gateway:
        return self.app[GATEWAY]

    async def __aenter__(self) -> Replica:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.http is not None
        await self.http.close()
        await self.runner.cleanup()

    async def post(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        assert self.http is not None
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def get_text(self, path: str) -> str:
        assert self.http is not None
        async with self.http.get(self.url + path) as resp:
            return await resp.text()

    async def admin(self, method: str, path: str) -> tuple[int, Any]:
        assert self.http is not None
        async with self.http.request(method, self.url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def workers():
    ws = [Worker(f"w{i}") for i in range(3)]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        await w.stop()


def replica_config(workers: list[Worker], url: str, key_prefix: str) -> GatewayConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": 4}],
        "workers": [{"id": w.worker_id, "url": f"http://127.0.0.1:{w.port}", "model": "m", "events_endpoint": None,
                     "load_path": None, "snapshot_path": None} for w in workers],
        "policy": STICKY,
        "admin": {"token": TOKEN},
        "health": {"interval_s": 3600},
        "sessions": {"store": "redis", "url": url, "key_prefix": key_prefix, "idle_timeout_s": 60,
                     "reconnect_interval_s": 0.05, "command_timeout_s": 5.0,
                     "connect_timeout_s": 5.0},
    })


async def turn(h: Replica, session_id: str, text: str) -> tuple[str, str]:
    status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": text, "max_tokens": 4},
                                         headers={"x-session-id": session_id})
    assert status == 200, body
    return headers["x-kvgate-worker"], headers["x-kvgate-decision"]


async def test_one_sessions_turns_go_to_one_worker_across_replicas(workers, redis_url, redis_key_prefix) -> None:
    config = replica_config(workers, redis_url, redis_key_prefix)
    async with Replica(config) as a, Replica(config) as b:
        owner, decision = await turn(a, "conv-1", "turn 0")
        assert decision == "sticky_new"
        for i in range(1, 7):
            replica = (a, b)[i % 2]
            assert await turn(replica, "conv-1", f"turn {i}") == (owner, "sticky")

        # Concurrent first requests of new sessions on both replicas: each session gets exactly one owner.
        firsts = await asyncio.gather(*(turn(r, f"race-{i}", "hello") for i in range(8) for r in (a, b)))
        for i in range(8):
            (wa, da), (wb, db) = firsts[2 * i], firsts[2 * i + 1]
            assert wa == wb
            assert sorted([da, db]) == ["sticky", "sticky_new"]

        # Failover seen by the other replica: a sees the owner die and moves the session; b follows the move
        # although b itself still believes the old owner is healthy.
        a.gw.fleet.workers[owner].is_healthy = False
        new_owner, decision = await turn(a, "conv-1", "turn 7")
        assert (decision, new_owner != owner) == ("sticky_moved", True)
        assert await turn(b, "conv-1", "turn 8") == (new_owner, "sticky")

        # Admin list and drop work across replicas.
        status, listed = await b.admin("GET", "/admin/sessions?limit=100")
        assert status == 200 and listed["num_sessions"] == 9
        assert {"session_key": "sid:conv-1", "worker_id": new_owner} in [
            {k: s[k] for k in ("session_key", "worker_id")} for s in listed["sessions"]]
        status, _ = await a.admin("DELETE", "/admin/sessions/sid:conv-1")
        assert status == 200
        assert (await turn(b, "conv-1", "turn 9"))[1] == "sticky_new"

        # Filtered listing and bulk drop: one replica drops a worker's race sessions, the other sees them gone.
        status, listed = await b.admin("GET", "/admin/sessions?key_prefix=sid:race-&limit=100")
        assert status == 200 and len(listed["sessions"]) == 8
        assert all(set(e) == {"session_key", "worker_id", "last_used_s", "created_s", "idle_s", "age_s"}
                   and e["age_s"] >= e["idle_s"] >= 0 for e in listed["sessions"])
        victim = listed["sessions"][0]["worker_id"]
        num_victim = sum(e["worker_id"] == victim for e in listed["sessions"])
        status, dropped = await a.admin("DELETE", f"/admin/sessions?worker_id={victim}&key_prefix=sid:race-")
        assert (status, dropped) == (200, {"num_dropped": num_victim})
        status, listed = await b.admin("GET", "/admin/sessions?key_prefix=sid:race-")
        assert len(listed["sessions"]) == 8 - num_victim
        assert all(e["worker_id"] != victim for e in listed["sessions"])
        status, refused = await a.admin("DELETE", "/admin/sessions")
        assert status == 400 and refused["error"]["param"] == "all"
        status, dropped = await a.admin("DELETE", "/admin/sessions?all=true")
        assert status == 200 and dropped["num_dropped"] == 8 - num_victim + 1  # and sid:conv-1
        status, listed = await b.admin("GET", "/admin/sessions")
        assert (listed["num_sessions"], listed["sessions"]) == (0, [])


async def test_replicas_keep_serving_while_redis_is_down(workers, restartable_redis, redis_key_prefix) -> None:
    config = replica_config(workers, restartable_redis.url, redis_key_prefix)
    async with Replica(config) as a, Replica(config) as b:
        owner, _ = await turn(a, "conv-1", "turn 0")
        assert await turn(b, "conv-1", "turn 1") == (owner, "sticky")
        restartable_redis.stop()
        for i in range(2, 6):  # no request fails; the session stays on its owner on both replicas
            assert (await turn((a, b)[i % 2], "conv-1", f"turn {i}"))[0] == owner
        metrics = await a.get_text("/metrics")
        assert "kvgate_sessions_store_degraded 1.0" in metrics
        restartable_redis.start()

        async def converged() -> bool:
            return not a.gw.sessions.stats().is_degraded and not b.gw.sessions.stats().is_degraded

        async with asyncio.timeout(10.0):
            while not await converged():
                await asyncio.sleep(0.01)
        assert await turn(b, "conv-1", "turn 6") == (owner, "sticky")
        assert await turn(a, "conv-1", "turn 7") == (owner, "sticky")
        assert "kvgate_sessions_store_degraded 0.0" in await a.get_text("/metrics")
