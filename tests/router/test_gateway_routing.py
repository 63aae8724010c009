"""Scenario tables: the gateway in front of loopback fake workers publishing real KV events over ZMQ."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from common.tokenization import encode_prompt, load_tokenizer
from events.types import Medium
from tests.router.fakes import BLOCK_SIZE, FakeWorker
from tests.router.harness import Clock, GatewayHarness, index_holds, make_config, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOKENIZER, _ = load_tokenizer(None)


def tokens(text: str) -> list[int]:
    return encode_prompt(TOKENIZER, text)


@pytest.fixture
async def workers():
    ws = [FakeWorker(f"w{i}") for i in range(3)]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        await w.stop()


PREFIX = "A" * 40  # 10 blocks of 4 byte-tokens


@pytest.mark.parametrize(
    ("held", "expected_worker", "expected_cached"),
    [
        # worker -> number of prefix blocks it holds on GPU; longest prefix wins
        ({"w0": 2, "w1": 6, "w2": 4}, "w1", 24),
        ({"w0": 8, "w1": 6, "w2": 0}, "w0", 32),
        # full-prompt hit: vLLM still computes the last token -> (n - 1) // bs blocks
        ({"w2": 10}, "w2", 36),
    ],
)
async def test_longest_prefix_wins(workers, held, expected_worker, expected_cached):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        for w in workers:
            n = held.get(w.worker_id, 0)
            if n:
                w.store(tokens(PREFIX[: n * BLOCK_SIZE]))
                await wait_until(index_holds(h.gw, w.worker_id, n))
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX, "max_tokens": 2})
        assert status == 200, body
        assert headers["x-kvgate-worker"] == expected_worker
        assert int(headers["x-kvgate-predicted-cached-tokens"]) == expected_cached
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached
        assert h.gw.proxy.num_honesty_mismatches == 0


@pytest.mark.parametrize(
    ("mediums", "expected_worker"),
    [
        ({"w0": Medium.CPU, "w1": Medium.GPU}, "w1"),
        ({"w0": Medium.GPU, "w1": Medium.CPU}, "w0"),
    ],
)
async def test_tier_order_gpu_before_cpu(workers, mediums, expected_worker):
    prompt = "B" * 4000  # 1000 blocks: restore from CPU is not free
    async with GatewayHarness(make_config(workers[:2]), workers=workers[:2]) as h:
        for w in workers[:2]:
            w.store(tokens(prompt), mediums[w.worker_id])
            await wait_until(index_holds(h.gw, w.worker_id, 1000))
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": prompt})
        assert headers["x-kvgate-worker"] == expected_worker


async def test_load_overrides_cache_at_threshold(workers):
    """cache_aware with max_running_requests=2: a saturated holder loses to an idle worker."""
    config = make_config(workers[:2], policy={"name": "cache_aware", "max_running_requests": 2})
    prompt = "C" * 4000
    async with GatewayHarness(config, workers=workers[:2]) as h:
        workers[0].store(tokens(prompt))
        await wait_until(index_holds(h.gw, "w0", 1000))
        w0 = h.gw.fleet.workers["w0"]
        w0.num_inflight_requests = 1  # under the threshold: cache wins
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": prompt})
        assert headers["x-kvgate-worker"] == "w0"
        w0.num_inflight_requests = 2  # at the threshold: saturated, excluded
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": prompt})
        assert headers["x-kvgate-worker"] == "w1"
        w0.num_inflight_requests = 0


async def test_drain_and_forced_worker(workers):
    async with GatewayHarness(make_config(workers[:2]), workers=workers[:2]) as h:
        workers[0].store(tokens(PREFIX))
        await wait_until(index_holds(h.gw, "w0", 10))
        status, _ = await h.admin("POST", "/admin/workers/w0/drain")
        assert status == 200
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert headers["x-kvgate-worker"] == "w1"
        await h.admin("POST", "/admin/workers/w0/undrain")
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX + "x"})
        assert headers["x-kvgate-worker"] == "w0"
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX},
                                     headers={"X-SMG-Target-Worker": "w1"})
        assert headers["x-kvgate-worker"] == "w1"
        assert headers["x-kvgate-decision"] == "forced"


async def test_sticky_expiry_and_owner_death(workers):
    clock = Clock()
    config = make_config(
        workers[:2],
        policy={"name": "session_sticky", "inner": {"name": "round_robin"}},
        sessions={"idle_timeout_s": 60},
    )
    async with GatewayHarness(config, clock=clock, workers=workers[:2]) as h:
        hdr = {"x-session-id": "s1"}
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
        owner = headers["x-kvgate-worker"]
        for _ in range(3):  # round robin inside, but the session sticks
            _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
            assert headers["x-kvgate-worker"] == owner
            assert headers["x-kvgate-decision"] == "sticky"
        clock.now_s += 61  # idle past the timeout: routed afresh (new claim)
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
        assert headers["x-kvgate-decision"] == "sticky_new"
        owner = headers["x-kvgate-worker"]
        other = "w1" if owner == "w0" else "w0"
        h.gw.fleet.workers[owner].is_healthy = False  # the owner dies mid-session
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
        assert headers["x-kvgate-worker"] == other
        assert headers["x-kvgate-decision"] == "sticky_moved"
        sessions = await h.gw.sessions.list_sessions(10)
        assert [(s.session_key, s.worker_id) for s in sessions] == [("sid:s1", other)]


async def test_session_follows_a_retry_to_the_worker_that_served_it(workers):
    config = make_config(workers[:2], policy={"name": "session_sticky", "inner": {"name": "round_robin"}})
    async with GatewayHarness(config, workers=workers[:2]) as h:
        hdr = {"x-session-id": "s2"}
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
        owner = headers["x-kvgate-worker"]
        other = "w1" if owner == "w0" else "w0"
        owner_worker = workers[0] if owner == "w0" else workers[1]
        owner_worker.fail_statuses = [503]  # fails before the first byte: retried on the other worker
        num_owner_requests = len(owner_worker.requests)
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
        assert (status, headers["x-kvgate-worker"], headers["x-kvgate-decision"]) == (200, other, "retry")
        sessions = await h.gw.sessions.list_sessions(10)
        assert [(s.session_key, s.worker_id) for s in sessions] == [("sid:s2", other)]
        # The next turn goes straight to the worker that holds the conversation now, without trying the old owner.
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "hello"}, headers=hdr)
        assert (status, headers["x-kvgate-worker"], headers["x-kvgate-decision"]) == (200, other, "sticky")
        assert len(owner_worker.requests) == num_owner_requests + 1  # the failed attempt only


async def test_worker_removed_while_the_session_store_answers(workers):
    config = make_config(workers[:2], policy={"name": "session_sticky", "inner": {"name": "round_robin"}})
    async with GatewayHarness(config, workers=workers[:2]) as h:
        claim = h.gw.sessions.claim_or_touch
        removed: list[str] = []

        async def claim_then_remove(session_key: str, worker_id: str):  # the admin removes the worker meanwhile
            entry = await claim(session_key, worker_id)
            await h.gw.remove_worker(worker_id)
            removed.append(worker_id)
            return entry

        h.gw.sessions.claim_or_touch = claim_then_remove  # type: ignore[method-assign]
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": "hello"},
                                             headers={"x-session-id": "gone"})
        assert len(removed) == 1
        other = "w1" if removed[0] == "w0" else "w0"
        assert (status, headers["x-kvgate-worker"]) == (200, other), body


def _honesty(headers: dict[str, str], body: bytes) -> tuple[str, int, int]:
    usage = json.loads(body)["usage"]
    return (headers["x-kvgate-worker"], int(headers["x-kvgate-predicted-cached-tokens"]),
            usage["prompt_tokens_details"]["cached_tokens"])


async def test_a_refused_request_leaves_no_pending_blocks(workers):
    async with GatewayHarness(make_config(workers[:1]), workers=workers[:1]) as h:
        workers[0].fail_statuses = [400]  # e.g. max_tokens over the worker's limit: nothing was computed
        status, _, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert status == 400
        assert h.gw.indexes["m"].stats().counters["num_approx_blocks_withdrawn"] == 10  # its 10 full blocks
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert status == 200 and _honesty(headers, body) == ("w0", 0, 0)


@pytest.fixture
async def approx_workers():
    """Two fake workers that publish no events (the gateway routes them in approximate mode)."""
    ws = [FakeWorker("a0", with_events=False), FakeWorker("a1", with_events=False)]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        await w.stop()


async def test_a_retried_request_moves_its_pending_blocks_to_the_worker_that_served_it(approx_workers):
    w0, w1 = approx_workers
    async with GatewayHarness(make_config([w0, w1]), workers=[w0, w1]) as h:
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "B" * 8})
        first, second = (w0, w1) if headers["x-kvgate-worker"] == w0.worker_id else (w1, w0)
        first.fail_statuses = [500]  # the chosen worker fails before the first byte: retried on the other
        status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX},
                                          headers={"x-session-id": "t"})
        assert (status, headers["x-kvgate-decision"]) == (200, "retry")
        assert headers["x-kvgate-worker"] == second.worker_id
        # The next identical prompt goes where the blocks are, and the prediction is what that worker reports.
        status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert status == 200 and _honesty(headers, body) == (second.worker_id, 36, 36)


async def test_approximate_mode_worker_without_events(approx_workers):
    async with GatewayHarness(make_config(approx_workers)) as h:
        assert h.gw.fleet.workers["a0"].is_approximate
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        first = headers["x-kvgate-worker"]
        # the decision inserted the prompt's blocks for the chosen worker: the same prompt follows it
        _, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert headers["x-kvgate-worker"] == first
        assert int(headers["x-kvgate-predicted-cached-tokens"]) == 36
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
        _, decisions = await h.admin("GET", "/admin/decisions?limit=2")
        answers = [(d["worker_id"], d["predicted_cached_tokens"], d["answer"]) for d in decisions["decisions"]]
        assert answers == [  # newest first: each decision with the answer of its request
            (first, 36, {"served_by": first, "reported_cached_tokens": 36, "outcome": "ok"}),
            (first, 0, {"served_by": first, "reported_cached_tokens": 0, "outcome": "ok"}),
        ]


async def test_remove_worker_clears_index_and_sessions(workers):
    config = make_config(workers[:2], policy={"name": "session_sticky", "inner": {"name": "cache_aware"}})
    async with GatewayHarness(config, workers=workers[:2]) as h:
        workers[0].store(tokens(PREFIX))
        await wait_until(index_holds(h.gw, "w0", 10))
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX},
                                     headers={"x-session-id": "s"})
        assert headers["x-kvgate-worker"] == "w0"
        status, body = await h.admin("DELETE", "/admin/workers/w0")
        assert (status, body) == (200, {"removed": "w0"})
        assert "w0" not in h.gw.indexes["m"].stats().num_blocks_by_worker
        assert await h.gw.sessions.num_sessions() == 0
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX},
                                     headers={"x-session-id": "s"})
        assert headers["x-kvgate-worker"] == "w1"


async def test_new_sessions_on_an_idle_fleet_spread_and_requests_without_one_keep_configuration_order(workers):
    async with GatewayHarness(make_config(workers), workers=workers) as h:
        placed = []
        for i in range(6):  # one after the other: every worker idle and holding nothing of these prompts
            status, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": f"{i}" * 40},
                                              headers={"x-session-id": f"s{i}"})
            assert status == 200
            placed.append(headers["x-kvgate-worker"])
        assert placed == ["w0", "w1", "w2", "w0", "w1", "w2"]
        _, headers, _ = await h.post("/v1/completions", {"model": "m", "prompt": "z" * 40})
        assert headers["x-kvgate-worker"] == "w0"
        status, body = await h.admin("GET", "/admin/decisions?limit=1")
        terms = body["decisions"][0]["cost_terms"]
        assert sorted(terms) == ["w0", "w1", "w2"]
        t = terms["w0"]
        assert t["cost_s"] == pytest.approx(t["ttft_s"] + t["recompute_penalty_s"] + t["decode_load_penalty_s"])
        assert t["ttft_s"] == pytest.approx(t["overhead_s"] + t["queue_s"] + t["prefill_s"] + t["restore_s"])
        assert t["num_computed_tokens"] == 40
        assert t["recompute_penalty_s"] == pytest.approx(2.0 * t["prefill_s"]) and t["prefill_s"] > 0


async def test_a_new_sessions_cost_terms_are_what_the_sticky_policys_inner_ranked(workers):
    config = make_config(workers, policy={"name": "session_sticky", "inner": {"name": "cache_aware"}})
    async with GatewayHarness(config, workers=workers) as h:
        for _ in range(2):
            status, _, _ = await h.post("/v1/completions", {"model": "m", "prompt": "q" * 40},
                                        headers={"x-session-id": "s"})
            assert status == 200
        status, body = await h.admin("GET", "/admin/decisions?limit=2")
        returning, opening = body["decisions"]
        assert (opening["reason"], returning["reason"]) == ("sticky_new", "sticky")
        # The opening turn was ranked without the recompute penalty (a new session, policies/cache_aware.py), the
        # returning one with it (2.0 times the prefill of what each worker lacks).
        assert {w: t["recompute_penalty_s"] for w, t in opening["cost_terms"].items()} == {"w0": 0.0, "w1": 0.0,
                                                                                           "w2": 0.0}
        terms = returning["cost_terms"]
        assert [terms[w]["recompute_penalty_s"] == pytest.approx(2.0 * terms[w]["prefill_s"]) for w in terms] == [
            True, True, True]


async def test_a_503_of_the_gateways_own_is_logged_once_with_the_request_id(workers, caplog):
    async with GatewayHarness(make_config(workers[:1]), workers=workers[:1]) as h:
        status, _ = await h.admin("POST", "/admin/workers/w0/drain")
        assert status == 200
        with caplog.at_level("WARNING", logger="router.api"):
            status, headers, body = await h.post("/v1/completions", {"model": "m", "prompt": PREFIX})
        assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
        lines = [r.getMessage() for r in caplog.records if r.name == "router.api"]
        assert lines == [f"request {headers['X-Request-ID']} answered 503 (NoWorkerError): "
                         "no worker available for model 'm': all_workers_draining"]


async def test_a_stream_the_client_closes_after_done_keeps_its_reported_cached_tokens(workers):
    """The worker keeps its stream open after ``[DONE]``; the client reads the usage and ``[DONE]`` and closes, which
    cancels the gateway's handler: the usage it relayed still counts (the honesty check, the decision's answer)."""
    w0 = workers[0]
    async with GatewayHarness(make_config(workers[:1]), workers=workers[:1]) as h:
        w0.store(tokens(PREFIX))
        await wait_until(index_holds(h.gw, "w0", 10))
        w0.eof_release = asyncio.Event()
        async with aiohttp.ClientSession() as s:
            resp = await s.post(h.url + "/v1/completions", json={"model": "m", "prompt": PREFIX, "stream": True})
            request_id = resp.headers["X-Request-ID"]
            lines = []
            async for line in resp.content:
                lines.append(line.strip())
                if line.strip() == b"data: [DONE]":
                    break
            resp.close()  # gone before the worker's stream ended
        usage = json.loads(next(x for x in lines if b'"usage"' in x)[5:])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 36
        await wait_until(lambda: h.gw.router.recent.answer(request_id) is not None)
        assert h.gw.router.recent.answer(request_id) == {
            "served_by": "w0", "reported_cached_tokens": 36, "outcome": "client_gone"}
        assert sum(h.gw.metrics.worker("w0").num_mismatches.values()) == 0
        w0.eof_release.set()
