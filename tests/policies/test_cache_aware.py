"""cache_aware scenario tables: exact decisions and exact scores from the documented formula."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from policies import CacheAwareConfig, CacheAwarePolicy
from tests.policies.builders import BLOCK_SIZE, make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

R_LIN = 40_000.0
R_QUAD = 2.435e9
OVERHEAD_S = 0.003


def expected_ttft_s(
    n: int, k_gpu: int = 0, k_cpu: int = 0, k_pool: int = 0, pending: int = 0, waiting: int = 0, running: int = 0
) -> float:
    """The module docstring's formula, written out independently (default constants)."""
    k = k_gpu + k_cpu + k_pool
    queue = pending / R_LIN + waiting * 0.005 + running * 0.001
    prefill = (n - k) / R_LIN + (n * n - k * k) / R_QUAD
    restore = k_cpu * 131_072 / 55e9 + k_pool * 131_072 / 12.5e9
    return OVERHEAD_S + queue + prefill + restore


def policy(**fields: Any) -> CacheAwarePolicy:
    return CacheAwarePolicy(CacheAwareConfig(**fields))


def test_calibrated_default_prefill_of_32k_tokens_is_1_26_s():
    decision = policy().select(make_view(32_768), make_snapshot(make_worker("w0")))
    assert decision.scores["w0"] == pytest.approx(1.26 + OVERHEAD_S, abs=0.002)


def test_cpu_restore_of_32k_tokens_is_78_ms():
    decision = policy().select(make_view(32_768), make_snapshot(make_worker("w0", num_cpu_cached_tokens=32_768)))
    assert decision.scores["w0"] == pytest.approx(OVERHEAD_S + 32_768 * 131_072 / 55e9)
    assert 32_768 * 131_072 / 55e9 == pytest.approx(0.078, abs=0.001)


# (name, workers as (id, fields), num_prompt_tokens, config, expected worker, expected ranking, reason)
SCENARIOS = [
    (
        "longest prefix wins",
        [("w0", {}), ("w1", {"num_gpu_cached_tokens": 8 * BLOCK_SIZE}), ("w2", {"num_gpu_cached_tokens": 64 * 16})],
        2048,
        {},
        "w2",
        ("w2", "w1", "w0"),
        "min_ttft",
    ),
    (
        "queued prefill outweighs a short prefix",
        [("w0", {"num_gpu_cached_tokens": 512, "num_pending_prefill_tokens": 8192}), ("w1", {})],
        2048,
        {},
        "w1",
        ("w1", "w0"),
        "min_ttft",
    ),
    (
        "long prefix outweighs a busy queue",
        [("w0", {"num_gpu_cached_tokens": 30_720, "num_pending_prefill_tokens": 8192}), ("w1", {})],
        32_768,
        {},
        "w0",
        ("w0", "w1"),
        "min_ttft",
    ),
    (
        "running requests below the threshold: prefix still wins",
        [("w0", {"num_gpu_cached_tokens": 4096, "num_running_requests": 7}), ("w1", {})],
        4096,
        {"max_running_requests": 8},
        "w0",
        ("w0", "w1"),
        "min_ttft",
    ),
    (
        "running requests at the threshold: load overrides the prefix",
        [("w0", {"num_gpu_cached_tokens": 4096, "num_running_requests": 8}), ("w1", {})],
        4096,
        {"max_running_requests": 8},
        "w1",
        ("w1",),
        "min_ttft",
    ),
    (
        "kv usage at the threshold excludes",
        [("w0", {"num_gpu_cached_tokens": 4096, "kv_usage": 0.95}), ("w1", {"kv_usage": 0.94})],
        4096,
        {"max_kv_usage": 0.95},
        "w1",
        ("w1",),
        "min_ttft",
    ),
    (
        "pending prefill at the threshold excludes",
        [("w0", {"num_gpu_cached_tokens": 4096, "num_pending_prefill_tokens": 1000}), ("w1", {})],
        4096,
        {"max_pending_prefill_tokens": 1000},
        "w1",
        ("w1",),
        "min_ttft",
    ),
    (
        "all saturated: all compete",
        [("w0", {"num_running_requests": 9}), ("w1", {"num_gpu_cached_tokens": 1024, "num_running_requests": 8})],
        4096,
        {"max_running_requests": 8},
        "w1",
        ("w1", "w0"),
        "min_ttft_all_saturated",
    ),
    (
        "tier order: GPU over CPU over pool over nothing",
        [
            ("none", {}),
            ("pool", {"num_pool_cached_tokens": 16_384}),
            ("cpu", {"num_cpu_cached_tokens": 16_384}),
            ("gpu", {"num_gpu_cached_tokens": 16_384}),
        ],
        16_400,
        {},
        "gpu",
        ("gpu", "cpu", "pool", "none"),
        "min_ttft",
    ),
    (
        "GPU prefix continued on CPU beats a shorter GPU-only prefix",
        [
            ("w0", {"num_gpu_cached_tokens": 8192}),
            ("w1", {"num_gpu_cached_tokens": 4096, "num_cpu_cached_tokens": 12_288}),
        ],
        16_384,
        {},
        "w1",
        ("w1", "w0"),
        "min_ttft",
    ),
    (
        "tie: identical workers, configuration order",
        [("w0", {}), ("w1", {}), ("w2", {})],
        1024,
        {},
        "w0",
        ("w0", "w1", "w2"),
        "min_ttft",
    ),
    (
        "tie: equal score, more GPU-cached tokens first",
        [("cpu", {"num_cpu_cached_tokens": 1024}), ("gpu", {"num_gpu_cached_tokens": 1024})],
        1024,
        {"host_bandwidth_bytes_per_s": 1e18},
        "gpu",
        ("gpu", "cpu"),
        "min_ttft",
    ),
    (
        "tie: equal score and cache, fewer running requests first",
        [("w0", {"num_running_requests": 3}), ("w1", {"num_running_requests": 1}), ("w2", {"num_running_requests": 2})],
        1024,
        {"per_running_request_s": 0.0},
        "w1",
        ("w1", "w2", "w0"),
        "min_ttft",
    ),
    (
        "unhealthy and draining skipped even with the longest prefix",
        [
            ("w0", {"num_gpu_cached_tokens": 4096, "is_healthy": False}),
            ("w1", {"num_gpu_cached_tokens": 4096, "is_draining": True}),
            ("w2", {"num_gpu_cached_tokens": 16}),
        ],
        4096,
        {},
        "w2",
        ("w2",),
        "min_ttft",
    ),
]


@pytest.mark.parametrize(
    ("workers", "num_prompt_tokens", "config", "worker_id", "ranking", "reason"),
    [s[1:] for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
def test_scenario(workers, num_prompt_tokens, config, worker_id, ranking, reason):
    snapshot = make_snapshot(*(make_worker(w, **fields) for w, fields in workers))
    decision = policy(**config).select(make_view(num_prompt_tokens), snapshot)
    assert decision.worker_id == worker_id
    assert decision.ranking == ranking
    assert decision.reason == reason
    chosen = next(w for w in snapshot.workers if w.worker_id == worker_id)
    assert decision.predicted_cached_tokens == chosen.num_cached_tokens


def test_scores_are_the_formula_for_every_candidate_including_saturated():
    workers = [
        make_worker("w0", num_gpu_cached_tokens=1024, num_cpu_cached_tokens=512, num_pool_cached_tokens=256),
        make_worker("w1", num_pending_prefill_tokens=3000, num_waiting_requests=2, num_running_requests=9),
        make_worker("w2", is_healthy=False),
    ]
    decision = policy(max_running_requests=9).select(make_view(4000), make_snapshot(*workers))
    assert set(decision.scores) == {"w0", "w1"}
    assert decision.scores["w0"] == pytest.approx(expected_ttft_s(4000, k_gpu=1024, k_cpu=512, k_pool=256), rel=1e-12)
    assert decision.scores["w1"] == pytest.approx(expected_ttft_s(4000, pending=3000, waiting=2, running=9), rel=1e-12)
    assert decision.ranking == ("w0",)


def test_cached_tokens_beyond_the_prompt_are_clamped_gpu_first():
    worker = make_worker("w0", num_gpu_cached_tokens=900, num_cpu_cached_tokens=500, num_pool_cached_tokens=500)
    decision = policy().select(make_view(1000), make_snapshot(worker))
    assert decision.scores["w0"] == pytest.approx(expected_ttft_s(1000, k_gpu=900, k_cpu=100), rel=1e-12)


def test_explain_matches_scores():
    p = policy()
    workers = [make_worker("w0", num_cpu_cached_tokens=2048), make_worker("w1", num_running_requests=4)]
    view, snapshot = make_view(4096), make_snapshot(*workers)
    decision = p.select(view, snapshot)
    explained = p.explain(view, snapshot)
    assert {w: b.ttft_s for w, b in explained.items()} == pytest.approx(dict(decision.scores), rel=1e-12)
    assert explained["w0"].num_computed_tokens == 2048
    assert explained["w0"].restore_s == pytest.approx(2048 * 131_072 / 55e9)


def test_softmax_with_seeded_rng_matches_reference_draws():
    workers = [make_worker(f"w{i}", num_gpu_cached_tokens=1024 * i) for i in range(4)]
    snapshot, view = make_snapshot(*workers), make_view(4096)
    p = policy(temperature=0.5, seed=21)
    scores = policy().select(view, snapshot).scores
    ordered = sorted(scores, key=lambda w: scores[w])  # w3, w2, w1, w0
    low, high = scores[ordered[0]], scores[ordered[-1]]
    weights = [math.exp(-((scores[w] - low) / (high - low)) / 0.5) for w in ordered]
    reference = random.Random(21)
    counts = dict.fromkeys(ordered, 0)
    for _ in range(400):
        threshold = reference.random() * sum(weights)
        expected = ordered[next(i for i, c in enumerate(_cumsum(weights)) if threshold < c)]
        decision = p.select(view, snapshot)
        assert decision.worker_id == expected
        assert decision.reason == "softmax"
        assert decision.ranking == (expected, *(w for w in ordered if w != expected))
        counts[expected] += 1
    assert counts["w3"] > counts["w2"] > counts["w1"] > counts["w0"] > 0


def test_softmax_equal_scores_is_uniform_and_zero_temperature_is_argmin():
    snapshot = make_snapshot(*(make_worker(f"w{i}") for i in range(3)))
    reference = random.Random(4)
    p = policy(temperature=1.0, seed=4)
    for _ in range(30):
        assert p.select(make_view(), snapshot).worker_id == f"w{int(reference.random() * 3)}"
    argmin = policy(temperature=0.0, seed=4)
    assert {argmin.select(make_view(), snapshot).worker_id for _ in range(30)} == {"w0"}


def _cumsum(values):
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


@pytest.mark.parametrize(
    ("fields", "saturated"),
    [
        ({"num_running_requests": 7}, False),
        ({"num_running_requests": 8}, True),
        ({"kv_usage": 0.9}, True),
        ({"kv_usage": 0.89}, False),
        ({"num_pending_prefill_tokens": 4096}, True),
        ({"num_pending_prefill_tokens": 4095}, False),
    ],
)
def test_is_saturated_agrees_with_select(fields, saturated):
    p = policy(max_running_requests=8, max_kv_usage=0.9, max_pending_prefill_tokens=4096)
    worker = make_worker("w0", num_gpu_cached_tokens=16_384, **fields)
    assert p.is_saturated(worker) is saturated
    decision = p.select(make_view(16_384), make_snapshot(worker, make_worker("w1")))
    assert decision.worker_id == ("w1" if saturated else "w0")


@pytest.mark.unit
@pytest.mark.parametrize(("recompute_penalty", "worker_id"), [(0.0, "w1"), (1.0, "w0")])
def test_recompute_penalty_keeps_a_busy_holder_that_greedy_ttft_would_leave(recompute_penalty, worker_id):
    # w0 holds 12,288 of 16,384 tokens but has 20,000 tokens queued; w1 is idle and holds nothing.
    # TTFT: w0 0.6536 s, w1 0.5228 s (greedy picks w1). Ranking cost with penalty 1 adds each one's own prefill:
    # w0 0.6536 + 0.1506 = 0.8042, w1 0.5228 + 0.5198 = 1.0426 (w0 keeps its conversation).
    workers = (
        make_worker("w0", num_gpu_cached_tokens=12_288, num_pending_prefill_tokens=20_000),
        make_worker("w1"),
    )
    decision = policy(recompute_penalty=recompute_penalty).select(make_view(16_384), make_snapshot(*workers))
    assert decision.worker_id == worker_id
    assert decision.scores["w0"] == pytest.approx(expected_ttft_s(16_384, k_gpu=12_288, pending=20_000))
    assert decision.scores["w1"] == pytest.approx(expected_ttft_s(16_384))
    assert decision.scores["w0"] > decision.scores["w1"]


def expected_decode_load_s(n: int, running: int, inflight_tokens: int, steps: int) -> float:
    """``TTFTCostModel.decode_load_s`` written out (default constants: 2e-5 s per sequence, 131,072 B per token
    read at 4e12 B/s)."""
    b = 131_072 / 4e12
    return steps * (running * (2 * 2e-5 + n * b) + inflight_tokens * b)


def _view(n: int, max_tokens: int) -> Any:
    from policies.base import RequestView

    return RequestView("req-0", "llama-3-8b", n, max_tokens, BLOCK_SIZE)


@pytest.mark.parametrize(
    ("running", "decode_penalty", "expected"),
    [
        (0, 1.0, "w0"),  # the shared prefix wins on an idle worker
        (1, 1.0, "w0"),  # one decoding neighbour costs less than the 2,048 tokens the hit saves
        (4, 1.0, "w1"),  # four cost more: the idle worker takes the request
        (4, 0.0, "w0"),  # without the term the holder takes everything
    ],
)
def test_decode_load_moves_a_shared_prefix_off_a_busy_worker(running: int, decode_penalty: float,
                                                             expected: str) -> None:
    n, max_tokens = 4096, 1024  # charged over decode_horizon_tokens = 256 steps
    busy = make_worker("w0", num_gpu_cached_tokens=2048, num_running_requests=running,
                       num_inflight_prompt_tokens=running * n)
    idle = make_worker("w1")
    p = policy(decode_penalty=decode_penalty)
    decision = p.select(_view(n, max_tokens), make_snapshot(busy, idle))
    assert decision.worker_id == expected
    # Scores stay the TTFT estimate: the decode load ranks, it is not part of the TTFT.
    assert decision.scores["w0"] == pytest.approx(expected_ttft_s(n, k_gpu=2048, running=running), rel=1e-12)
    load_s = p.cost_model.decode_load_s(busy, n, max_tokens)
    assert load_s == pytest.approx(expected_decode_load_s(n, running, running * n, 256), rel=1e-12)
    assert p.explain(_view(n, max_tokens), make_snapshot(busy, idle))["w0"].decode_load_s == load_s
    # The exact crossing: the ranking costs of the two workers as the module docstring defines them.
    prefill_w0 = (n - 2048) / R_LIN + (n * n - 2048 * 2048) / R_QUAD
    prefill_w1 = n / R_LIN + n * n / R_QUAD
    cost_w0 = expected_ttft_s(n, k_gpu=2048, running=running) + 2.0 * prefill_w0 + decode_penalty * load_s
    cost_w1 = expected_ttft_s(n) + 2.0 * prefill_w1
    assert (cost_w0 < cost_w1) == (expected == "w0")


def test_decode_load_is_charged_over_max_tokens_when_shorter() -> None:
    worker = make_worker("w0", num_running_requests=3, num_inflight_prompt_tokens=5000)
    model = policy().cost_model
    assert model.decode_load_s(worker, 1000, 16) == pytest.approx(expected_decode_load_s(1000, 3, 5000, 16))
    assert model.decode_load_s(worker, 1000, 10_000) == pytest.approx(expected_decode_load_s(1000, 3, 5000, 256))
    assert model.decode_load_s(make_worker("w1"), 1000, 256) == 0.0


def test_queued_prefill_is_priced_with_its_attention_pairs():
    """A worker holding one long queued prompt is heavier than one holding more queued tokens in short prompts: the
    attention of the queued prompts (their token pairs) counts as the request's own does."""
    long_queue = make_worker("w0", num_pending_prefill_tokens=30_000, num_pending_prefill_token_pairs=30_000**2)
    short_queue = make_worker("w1", num_pending_prefill_tokens=35_000, num_pending_prefill_token_pairs=5 * 7_000**2)
    cache_aware = policy()
    decision = cache_aware.select(make_view(2_048), make_snapshot(long_queue, short_queue))
    prefill = 2_048 / R_LIN + 2_048**2 / R_QUAD
    assert decision.scores["w0"] == OVERHEAD_S + (30_000 / R_LIN + 9e8 / R_QUAD + prefill)
    assert decision.scores["w1"] == OVERHEAD_S + (35_000 / R_LIN + 2.45e8 / R_QUAD + prefill)
    assert round(decision.scores["w0"], 6) == 1.175532 and round(decision.scores["w1"], 6) == 1.031539
    assert decision.worker_id == "w1" and decision.ranking == ("w1", "w0")
    terms = cache_aware.cost_terms(make_view(2_048), make_snapshot(long_queue, short_queue))
    assert terms["w0"].queue_s == 30_000 / R_LIN + 9e8 / R_QUAD
    assert terms["w0"].ttft_s == decision.scores["w0"] and terms["w1"].ttft_s == decision.scores["w1"]
    # without the pairs (a worker the gateway knows nothing queued about) the linear part alone is left
    linear_only = cache_aware.select(make_view(2_048), make_snapshot(
        make_worker("w0", num_pending_prefill_tokens=30_000), make_worker("w1", num_pending_prefill_tokens=35_000)))
    assert linear_only.worker_id == "w0"
