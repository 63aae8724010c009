"""``POST /admin/workers`` on a loopback gateway: bad entries are JSON 400s naming the key, a worker whose event
subscription fails to start is rolled back completely (JSON 500, nothing registered, the next add works), and a
base URL with a trailing ``/`` works."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq

from events.subscriber import WorkerSpec
from tests.ports import free_port
from tests.router.fakes import FakeWorker
from tests.router.harness import TOKEN, GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[FakeWorker, FakeWorker]]:
    """``w0`` in the gateway's config and ``extra`` to add through the admin API (both without events)."""
    w0, extra = FakeWorker("w0", with_events=False), FakeWorker("extra", with_events=False)
    for w in (w0, extra):
        await w.start()
    yield w0, extra
    for w in (w0, extra):
        await w.stop()


async def call(h: GatewayHarness, method: str, path: str, body: Any = None) -> tuple[int, str, Any]:
    assert h.session is not None
    async with h.session.request(method, h.url + path, json=body, headers=AUTH) as resp:
        return resp.status, resp.content_type, await resp.json(content_type=None)


def error(message: str, *, type_: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


async def worker_ids(h: GatewayHarness) -> list[str]:
    status, _, body = await call(h, "GET", "/admin/workers")
    assert status == 200
    return [w["id"] for w in body["workers"]]


# -- dp_ranks --------------------------------------------------------------------------------------------------------


async def test_dp_ranks_too_large_is_a_400_naming_the_key_and_adds_nothing(fleet):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:
        entry = {"id": "w9", "url": extra.url, "model": "m", "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                 "dp_ranks": 3000}
        status, ctype, body = await call(h, "POST", "/admin/workers", entry)
        assert (status, ctype, body) == (400, "application/json",
                                         error("worker: dp_ranks must be in 1..256, got 3000"))
        assert await worker_ids(h) == ["w0"]
        assert "w9" not in h.gw.subscriber._specs
        # A rank's port past 65535 is refused the same way.
        status, _, body = await call(h, "POST", "/admin/workers", {**entry, "dp_ranks": 100,
                                                                   "events_endpoint": "tcp://127.0.0.1:65500"})
        assert (status, body) == (400, error(
            "worker: events_endpoint 'tcp://127.0.0.1:65500' with dp_ranks 100: rank r uses port 65500 + r, so "
            "rank 99 would use port 65599, over 65535"))
        assert await worker_ids(h) == ["w0"]
        assert "w9" not in h.gw.subscriber._specs


# -- a subscription that fails to start ----------------------------------------------------------------------------


@pytest.mark.parametrize(("failure", "detail"), [
    (zmq.ZMQError(errno.EMFILE), "ZMQError: Too many open files"),  # ZMQ out of sockets, as with dp_ranks 3000
    (RuntimeError("boom"), "RuntimeError: boom"),
])
async def test_add_whose_subscription_fails_is_rolled_back_then_a_normal_add_works(fleet, failure, detail):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:
        sub = h.gw.subscriber
        add_worker = sub.add_worker
        failures = [failure]

        def add_rank(spec: WorkerSpec) -> None:  # ranks 0 and 1 subscribe for real, rank 2 fails (once)
            if spec.dp_rank == 2 and failures:
                raise failures.pop()
            add_worker(spec)

        sub.add_worker = add_rank
        entry = {"id": "w9", "url": extra.url, "model": "m", "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                 "dp_ranks": 4}
        status, ctype, body = await call(h, "POST", "/admin/workers", entry)
        assert (status, ctype, body) == (500, "application/json", error(
            f"worker 'w9' was not added: its event subscription (events_endpoint {entry['events_endpoint']!r}, "
            f"dp_ranks 4) could not start ({detail})", type_="internal_error"))
        # Nothing of it is left: not in the fleet, no subscription, no socket of ranks 0 and 1.
        assert await worker_ids(h) == ["w0"]
        assert [w.worker_id for w in h.gw.fleet.candidates("m")] == ["w0"]
        assert "w9" not in sub._specs
        assert [key for key in sub._sources if key[0] == "w9"] == []
        # The same add, once the subscription can start, registers it with all its ranks.
        status, _, body = await call(h, "POST", "/admin/workers", entry)
        assert (status, body["id"], body["url"]) == (201, "w9", extra.url)
        assert await worker_ids(h) == ["w0", "w9"]
        assert sorted(sub._specs["w9"]) == [0, 1, 2, 3]
        assert sorted(key for key in sub._sources if key[0] == "w9") == [("w9", 0), ("w9", 1), ("w9", 2), ("w9", 3)]


async def test_an_unexpected_admin_failure_is_a_json_500(fleet, monkeypatch):
    w0, _ = fleet
    async with GatewayHarness(make_config([w0])) as h:
        def remove(worker_id: str) -> None:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(h.gw.fleet, "remove", remove)
        status, ctype, body = await call(h, "DELETE", "/admin/workers/w0")
        assert (status, ctype, body) == (500, "application/json", error(
            "internal error: OSError: [Errno 24] Too many open files", type_="internal_error"))


# -- url -------------------------------------------------------------------------------------------------------------


async def test_url_with_a_trailing_slash_is_normalized_and_works(fleet):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:
        status, _, body = await call(h, "POST", "/admin/workers", {"id": "w9", "url": extra.url + "/", "model": "m"})
        assert (status, body["url"]) == (201, extra.url)
        worker = h.gw.fleet.get("w9")
        for _ in range(h.gw.config.health.failure_threshold):  # "//health" would fail each check
            await h.gw.fleet.check_health_once([worker])
        assert worker.is_healthy
        async with aiohttp.ClientSession() as s, s.post(
            h.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 1},
            headers={"x-kvgate-worker": "w9"},
        ) as resp:
            assert (resp.status, resp.headers["x-kvgate-worker"]) == (200, "w9")
        assert len(extra.requests) == 1


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "//", "?a=1", "#frag"])
async def test_url_with_a_path_query_or_fragment_is_a_400_naming_the_key(fleet, suffix):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:
        url = extra.url + suffix
        status, ctype, body = await call(h, "POST", "/admin/workers", {"id": "w9", "url": url, "model": "m"})
        assert (status, ctype, body) == (400, "application/json", error(
            "worker: url must be a base URL, http(s)://host[:port], without a path, query or fragment (request "
            f"paths such as /v1/completions are appended to it), got {url!r}"))
        assert await worker_ids(h) == ["w0"]


async def test_url_with_another_scheme_is_a_400_naming_the_key(fleet):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:
        url = extra.url.replace("http://", "ws://")
        status, _, body = await call(h, "POST", "/admin/workers", {"id": "w9", "url": url, "model": "m"})
        assert (status, body) == (400, error(f"worker: url must start with http:// or https://, got {url!r}"))
        assert await worker_ids(h) == ["w0"]


# -- block size ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [2, 6])
async def test_block_size_not_a_multiple_of_the_models_is_a_400(fleet, block_size):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:  # the model's block_size is 4
        entry = {"id": "w9", "url": extra.url, "model": "m", "block_size": block_size}
        status, _, body = await call(h, "POST", "/admin/workers", entry)
        assert (status, body) == (400, error(
            f"worker: block_size {block_size} is not a multiple of the block_size 4 of its model 'm' "
            "(models[].block_size): its events could not be indexed", param="block_size"))
        assert await worker_ids(h) == ["w0"]
        status, _, body = await call(h, "POST", "/admin/workers", {**entry, "block_size": 8})
        assert (status, body["block_size"]) == (201, 8)


async def test_an_overflowing_float_in_the_json_body_is_a_400(fleet):
    """JSON cannot write NaN or infinity; a literal that overflows a float is refused as invalid JSON."""
    w0, extra = fleet
    async with GatewayHarness(make_config([w0])) as h:
        assert h.session is not None
        raw = b'{"id": "w9", "url": "%s", "model": "m", "time_scale": 1e999}' % extra.url.encode()
        async with h.session.post(h.url + "/admin/workers", data=raw,
                                  headers={**AUTH, "Content-Type": "application/json"}) as resp:
            assert (resp.status, await resp.json()) == (400, error(
                "the request body is not valid JSON: Number out of range - at `$[...]`"))
        assert await worker_ids(h) == ["w0"]


# -- the first health check ------------------------------------------------------------------------------------------


async def test_an_added_worker_that_does_not_answer_is_unhealthy_at_once_and_gets_no_request(fleet):
    w0, extra = fleet
    async with GatewayHarness(make_config([w0], health={"interval_s": 3600, "timeout_s": 1.0})) as h:
        status, _, body = await call(h, "POST", "/admin/workers",
                                     {"id": "dead", "url": f"http://127.0.0.1:{free_port()}", "model": "m"})
        assert (status, body["id"], body["is_healthy"]) == (201, "dead", False)
        status, _, body = await call(h, "POST", "/admin/workers", {"id": "extra", "url": extra.url, "model": "m"})
        assert (status, body["is_healthy"]) == (201, True)
        served = set()
        for i in range(6):
            status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": f"p{i}"})
            assert status == 200 and headers["x-kvgate-decision"] != "retry"  # never tried on "dead" first
            served.add(headers["x-kvgate-worker"])
        assert served <= {"w0", "extra"}
