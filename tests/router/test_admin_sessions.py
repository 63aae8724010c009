"""``/admin/sessions`` on a loopback gateway with the memory store: the listing's ``age_s`` and ``idle_s`` on an
injected clock, its filters, the bulk ``DELETE`` by the same filters, and 400s naming a bad parameter."""

from __future__ import annotations

import pytest

from tests.router.harness import GatewayHarness, make_config
from tests.sessions.fakes import FakeClock

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_list_filter_and_bulk_drop_sessions(workers):
    clock = FakeClock()
    config = make_config(workers, policy={"name": "session_sticky", "inner": {"name": "round_robin"}})
    async with GatewayHarness(config, clock=clock, workers=workers) as h:
        owner = {}
        for at_s, session in ((1000.0, "t1-a"), (1002.0, "t1-b"), (1005.0, "t2-c")):
            clock.now_s = at_s
            status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 1},
                                              headers={"x-session-id": session})
            assert (status, headers["x-kvgate-decision"]) == (200, "sticky_new")
            owner[session] = headers["x-kvgate-worker"]
        assert owner["t1-a"] == owner["t2-c"] != owner["t1-b"]  # round robin over two workers
        w_a, w_b = owner["t1-a"], owner["t1-b"]
        clock.now_s = 1010.0
        status, listed = await h.admin("GET", "/admin/sessions")
        assert status == 200 and listed == {"num_sessions": 3, "sessions": [
            {"session_key": "sid:t2-c", "worker_id": w_a, "last_used_s": 1005.0, "created_s": 1005.0,
             "idle_s": 5.0, "age_s": 5.0},
            {"session_key": "sid:t1-b", "worker_id": w_b, "last_used_s": 1002.0, "created_s": 1002.0,
             "idle_s": 8.0, "age_s": 8.0},
            {"session_key": "sid:t1-a", "worker_id": w_a, "last_used_s": 1000.0, "created_s": 1000.0,
             "idle_s": 10.0, "age_s": 10.0}]}

        async def keys(query: str) -> list[str]:
            status, got = await h.admin("GET", "/admin/sessions?" + query)
            assert status == 200, got
            return [e["session_key"] for e in got["sessions"]]

        assert await keys(f"worker_id={w_a}") == ["sid:t2-c", "sid:t1-a"]
        assert await keys("key_prefix=sid:t1-") == ["sid:t1-b", "sid:t1-a"]
        assert await keys("min_idle_s=8") == ["sid:t1-b", "sid:t1-a"]
        assert await keys("max_idle_s=8&min_age_s=6") == ["sid:t1-b"]
        assert await keys("limit=1") == ["sid:t2-c"]

        for query, param in (("min_idle_s=-1", "min_idle_s"), ("max_idle_s=soon", "max_idle_s"),
                             ("min_age_s=inf", "min_age_s"), ("worker_id=", "worker_id"), ("worker=w0", "worker")):
            status, refused = await h.admin("GET", "/admin/sessions?" + query)
            assert status == 400 and refused["error"]["param"] == param, (query, refused)
            assert refused["error"]["type"] == "invalid_request_error"
        status, refused = await h.admin("DELETE", "/admin/sessions")
        assert status == 400 and refused["error"]["param"] == "all"
        status, refused = await h.admin("DELETE", "/admin/sessions?all=yes")
        assert status == 400 and refused["error"]["param"] == "all"
        status, refused = await h.admin("DELETE", "/admin/sessions?limit=3")
        assert status == 400 and refused["error"]["param"] == "limit"

        assert await h.admin("DELETE", "/admin/sessions?key_prefix=sid:t1-&min_idle_s=9") == (200, {"num_dropped": 1})
        assert await keys("") == ["sid:t2-c", "sid:t1-b"]
        assert await h.admin("DELETE", "/admin/sessions?all=true") == (200, {"num_dropped": 2})
        assert await h.admin("GET", "/admin/sessions") == (200, {"num_sessions": 0, "sessions": []})
        assert await h.admin("GET", "/admin/sessions", token="wrong") == (401, {"error": {
            "message": "missing or wrong admin bearer token", "type": "authentication_error", "param": None,
            "code": None}})


async def test_a_parameter_given_twice_or_not_in_plain_decimal_is_refused_and_nothing_is_dropped(workers):
    """``worker_id=a&worker_id=b`` used to act on ``a`` alone (a bulk DELETE dropping other sessions than the
    operator meant), ``min_idle_s=1&min_idle_s=x`` took the 1 and ignored the x, and ``limit=1_0`` / ``min_idle_s=
    1_000`` / ``limit= 5`` read as 10 / 1000 / 5 (Python's ``int`` and ``float`` take underscores and blanks): each is
    a 400 naming the parameter, and no session is dropped."""
    config = make_config(workers, policy={"name": "session_sticky", "inner": {"name": "round_robin"}})
    async with GatewayHarness(config, workers=workers) as h:
        for session in ("a", "b"):
            status, _, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 1},
                                        headers={"x-session-id": session})
            assert status == 200
        both = ("GET", "DELETE")
        for query, param, message, methods in (
            ("worker_id=w0&worker_id=w1", "worker_id", "worker_id is given 2 times; give it once", both),
            ("min_idle_s=0&min_idle_s=x", "min_idle_s", "min_idle_s is given 2 times; give it once", both),
            ("all=true&all=false", "all", "all is given 2 times; give it once", ("DELETE",)),
            ("min_idle_s=1_000", "min_idle_s", "min_idle_s must be a number of seconds >= 0, got '1_000'", both),
            ("min_age_s=%201", "min_age_s", "min_age_s must be a number of seconds >= 0, got ' 1'", both),
        ):
            for method in methods:
                status, refused = await h.admin(method, "/admin/sessions?" + query)
                assert (status, refused["error"]["param"], refused["error"]["message"]) == (400, param, message), (
                    method, query)
        for query, message in (("limit=1_0", "limit must be an integer, got '1_0'"),
                               ("limit=%205", "limit must be an integer, got ' 5'"),
                               ("limit=1&limit=2", "limit is given 2 times; give it once")):
            status, refused = await h.admin("GET", "/admin/sessions?" + query)
            assert (status, refused["error"]["param"], refused["error"]["message"]) == (400, "limit", message)
        status, listed = await h.admin("GET", "/admin/sessions")
        assert status == 200 and listed["num_sessions"] == 2
