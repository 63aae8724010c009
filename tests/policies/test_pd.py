"""The PD pair choice (``policies.pd``) in scenario tables, and the gateway's reservation ledger
(``router.pd_ledger``): exact workers, exact reserved blocks, exact scores from the docstring's formulas."""

from __future__ import annotations

import pytest

from policies.base import RequestView, Snapshot, WorkerState
from policies.cache_aware import CacheAwarePolicy
from policies.config import CacheAwareConfig
from policies.cost_model import TTFTCostModel
from policies.pd import DecodeCandidate, PDPolicy, PDTransferConfig
from router.pd_ledger import DecodeLedger

pytestmark = pytest.mark.unit

CFG = CacheAwareConfig(enable_calibration=False)
LINK = PDTransferConfig(kv_bytes_per_token=1000, link_bytes_per_s=1e6, transfer_latency_s=0.001)


def policy(config: PDTransferConfig = LINK) -> PDPolicy:
    return PDPolicy(CacheAwarePolicy(CFG), TTFTCostModel(CFG), config)


def view(n: int = 64, m: int = 16, bs: int = 16) -> RequestView:
    return RequestView("r1", "m", n, m, bs)


PREFILLS = Snapshot(
    (
        WorkerState("p0", num_gpu_cached_tokens=0),
        WorkerState("p1", num_gpu_cached_tokens=48),
    )
)


def dec(wid: str, free: int = 100, **kw: int) -> DecodeCandidate:
    return DecodeCandidate(wid, num_free_blocks=free, num_total_blocks=100, **kw)  # type: ignore[arg-type]


# (decode candidates, session owner) -> (decode chosen, reason, reserved blocks on it)
# n=64, m=16, bs=16: ceil(80/16) = 5 blocks, minus local full blocks
DECODE_TABLE = [
    pytest.param((dec("d0"), dec("d1")), None, ("d0", "min_decode_cost", 5), id="tie-config-order"),
    pytest.param((dec("d0", 3), dec("d1")), None, ("d1", "min_decode_cost", 5), id="d0-too-few-free-blocks"),
    pytest.param(
        (dec("d0", num_reserved_blocks=96), dec("d1", 4)), None, (None, "no_decode_capacity", 0), id="none-fits"
    ),
    pytest.param(
        (dec("d0", num_running_requests=3, num_inflight_prompt_tokens=3000), dec("d1")),
        None,
        ("d1", "min_decode_cost", 5),
        id="decode-load",
    ),
    pytest.param((dec("d0", num_bytes_ahead=10_000), dec("d1")), None, ("d1", "min_decode_cost", 5), id="link-busy"),
    pytest.param(
        (dec("d0"), dec("d1", num_gpu_cached_tokens=32)), None, ("d1", "min_decode_cost", 3), id="local-prefix"
    ),
    pytest.param((dec("d0"), dec("d1")), "d1", ("d1", "sticky", 5), id="sticky-owner-fits"),
    pytest.param((dec("d0"), dec("d1", 2)), "d1", ("d0", "min_decode_cost", 5), id="sticky-owner-full"),
    pytest.param((dec("d0", is_healthy=False), dec("d1")), None, ("d1", "min_decode_cost", 5), id="unhealthy"),
]


@pytest.mark.parametrize(("decodes", "owner", "want"), DECODE_TABLE)
def test_decode_choice(decodes, owner, want) -> None:
    pair = policy().select(view(), PREFILLS, decodes, owner)
    assert (pair.decode.worker_id, pair.decode.reason, pair.num_reserved_blocks) == want
    assert pair.prefill.worker_id == "p1"  # the prefix lives on p1
    assert pair.is_routable == (want[0] is not None)


def test_scores_follow_the_formulas() -> None:
    p = policy()
    v = view()
    d1 = dec("d1", num_gpu_cached_tokens=32, num_bytes_ahead=5000)
    pair = p.select(v, PREFILLS, (dec("d0"), d1))
    # d0: pulls 64 tokens = 64,000 B; d1: pulls 32 tokens behind 5,000 B ahead
    assert pair.decode.scores["d0"] == pytest.approx(0.001 + 64_000 / 1e6)
    assert pair.decode.scores["d1"] == pytest.approx(0.001 + (5000 + 32_000) / 1e6)
    assert pair.decode.worker_id == "d1" and pair.num_transfer_bytes == 32_000
    assert pair.transfer_s == pytest.approx(0.038)
    ttft = CacheAwarePolicy(CFG).select(v, PREFILLS).scores
    assert pair.prefill.scores == pytest.approx({w: s + 0.038 for w, s in ttft.items()})
    assert pair.fits == {"d0": True, "d1": True}
    assert pair.prefill.predicted_cached_tokens == 48


def test_reserved_fraction_caps_what_the_gateway_reserves() -> None:
    p = policy(PDTransferConfig(kv_bytes_per_token=1000, link_bytes_per_s=1e6, max_reserved_fraction=0.5))
    assert p.available_blocks(dec("d0", 100, num_reserved_blocks=46)) == 4
    pair = p.select(view(), PREFILLS, (dec("d0", 100, num_reserved_blocks=46),))
    assert pair.decode.worker_id is None and pair.fits == {"d0": False}


def test_no_decode_workers_at_all() -> None:
    pair = policy().select(view(), PREFILLS, ())
    assert pair.decode.worker_id is None and pair.decode.reason == "no_decode_worker"
    with pytest.raises(ValueError, match="max_reserved_fraction"):
        PDTransferConfig(max_reserved_fraction=0)


def test_ledger_reserve_move_release_exactly_once() -> None:
    ledger = DecodeLedger()
    ledger.reserve("a", "d0", 5, 64_000)
    ledger.reserve("b", "d0", 3, 32_000)
    assert (ledger.reserved_blocks("d0"), ledger.bytes_ahead("d0"), ledger.num_reservations("d0")) == (8, 96_000, 2)
    with pytest.raises(ValueError, match="already holds"):
        ledger.reserve("a", "d1", 1, 0)
    ledger.transfer_landed("a")
    ledger.transfer_landed("a")
    assert (ledger.reserved_blocks("d0"), ledger.bytes_ahead("d0")) == (8, 32_000)
    ledger.move("b", "d1", 4, 40_000)  # a refusing decode worker: retried on d1
    assert (ledger.reserved_blocks("d0"), ledger.bytes_ahead("d0")) == (5, 0)
    assert (ledger.reserved_blocks("d1"), ledger.bytes_ahead("d1"), ledger.num_reservations("d1")) == (4, 40_000, 1)
    assert ledger.release("a") is not None and ledger.release("a") is None
    assert ledger.forget_worker("d1") == ["b"]
    assert len(ledger) == 0 and ledger.reserved_blocks("d0") == 0 and ledger.bytes_ahead("d1") == 0
    assert (ledger.num_reserved_total, ledger.num_released_total) == (3, 3)


def test_never_fits_only_when_no_usable_decode_worker_could_hold_the_request_empty() -> None:
    """n=64, m=16, bs=16: 5 blocks; a worker's capacity is its total blocks times ``max_reserved_fraction``
    (free blocks and reservations are what waiting can change, so they never make a request too large)."""
    p = policy()
    small = DecodeCandidate("d0", num_free_blocks=0, num_total_blocks=4, num_reserved_blocks=4)
    assert p.never_fits(view(), (small,)) == (5, 4)
    assert p.never_fits(view(), (small, dec("d1", 0, num_reserved_blocks=100))) is None  # d1 holds 5 once empty
    # a worker that holds the prompt's first 2 blocks needs 3 there, and 3 fit in 4
    assert p.never_fits(view(), (DecodeCandidate("d0", 4, 4, num_gpu_cached_tokens=32),)) is None
    # the bigger one drains or is down: it does not count
    assert p.never_fits(view(), (small, DecodeCandidate("d1", 100, 100, is_draining=True))) == (5, 4)
    assert p.never_fits(view(), (small, DecodeCandidate("d1", 100, 100, is_healthy=False))) == (5, 4)
    assert p.never_fits(view(), ()) is None
    half = policy(PDTransferConfig(max_reserved_fraction=0.5))
    assert half.never_fits(view(), (DecodeCandidate("d0", 9, 9),)) == (5, 4)  # int(9 * 0.5) = 4
    assert half.never_fits(view(), (DecodeCandidate("d0", 10, 10),)) is None
