"""``loadgen.fleet.Fleet.gateway_config``: a paced sim worker is listed with its time scale, so the gateway's cost
model drains its queue in the worker's seconds (the config parses, and the worker's runtime carries the scale)."""

from pathlib import Path

import pytest

from loadgen.fleet import GATEWAY_STOP_GRACE_S, Fleet, ManagedProcess
from router.config import parse_config
from router.gateway import DRAIN_END_TIMEOUT_S

pytestmark = pytest.mark.unit


def fleet_of(tmp_path: Path, time_scales: dict[str, float]) -> Fleet:
    fleet = Fleet(tmp_path)
    for i, (name, scale) in enumerate(time_scales.items()):
        fleet.workers.append(ManagedProcess(name=name, url=f"http://127.0.0.1:{9000 + i}", log_path=tmp_path / "x",
                                            popen=None, events_endpoint=f"tcp://127.0.0.1:{9100 + i}"))
        fleet.time_scales[name] = scale
    return fleet


def test_paced_workers_carry_their_time_scale_and_unpaced_ones_none(tmp_path):
    fleet = fleet_of(tmp_path, {"w0": 0.2, "w1": 0.0})
    raw = fleet.gateway_config({"name": "cache_aware"}, 8000, 16)
    assert [w.get("time_scale") for w in raw["workers"]] == [0.2, None]
    config = parse_config(raw)
    assert [w.time_scale for w in config.workers] == [0.2, 1.0]


def test_switched_off_every_worker_is_at_the_default_scale(tmp_path):
    fleet = fleet_of(tmp_path, {"w0": 0.2})
    fleet.enable_gateway_time_scale = False
    raw = fleet.gateway_config({"name": "cache_aware"}, 8000, 16)
    assert "time_scale" not in raw["workers"][0]
    assert parse_config(raw).workers[0].time_scale == 1.0


def test_a_gateways_kill_timeout_outlasts_its_graceful_stop():
    """SIGTERM to SIGKILL for a gateway is longer than the drain of the config ``gateway_config`` writes (the default
    ``listen.shutdown_grace_s``, then ``DRAIN_END_TIMEOUT_S`` for the streams it ends and as long for aiohttp's
    wait): a restart the fleet calls graceful never turns into a ``kill -9`` that cuts the streams in flight."""
    listen = parse_config(Fleet(Path(".")).gateway_config({"name": "round_robin"}, 8000, 16)).listen
    assert GATEWAY_STOP_GRACE_S > listen.shutdown_grace_s + 2 * DRAIN_END_TIMEOUT_S
    assert ManagedProcess(name="w", url="", log_path=Path("x"), popen=None).stop_grace_s < GATEWAY_STOP_GRACE_S
