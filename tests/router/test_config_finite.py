"""Every float of the gateway config refuses NaN and infinities (YAML ``.nan``, ``.inf``, ``-.inf``), naming the key.

NaN passes any range check written ``value <= 0`` (every comparison with NaN is false) and msgspec's ``gt=0``
ranges let infinity through; before the fix ``timeouts.first_byte_s: .nan`` turned every routed request into a
plain-text 500 and ``health.interval_s: .nan`` stopped the health loop.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from events.subscriber import SubscriberConfig
from policies.config import CacheAwareConfig, SessionStickyConfig, decode_policy_config
from policies.errors import PolicyConfigError
from router.cli import main
from router.config import (
    EventsConfig,
    GatewayConfig,
    HealthConfig,
    ModelConfig,
    RetryConfig,
    TimeoutsConfig,
    WorkerConfig,
)
from router.discovery import DiscoveryConfig
from router.index.config import IndexConfig
from router.index.errors import IndexConfigError
from router.sessions.config import SessionsConfig
from router.sessions.errors import SessionConfigError

pytestmark = pytest.mark.unit

NAN = float("nan")
INF = float("inf")

FLOAT_KEYS: list[tuple[str | int, ...]] = [
    ("listen", "body_timeout_s"),
    ("listen", "shutdown_grace_s"),
    ("models", 0, "pending_blocks_ttl_s"),
    ("models", 0, "prompt_cache_idle_s"),
    ("models", 0, "pd", "link_bytes_per_s"),
    ("models", 0, "pd", "transfer_latency_s"),
    ("models", 0, "pd", "max_reserved_fraction"),
    ("models", 0, "pd", "queue_timeout_s"),
    ("models", 0, "pd", "retry_after_s"),
    ("workers", 0, "time_scale"),
    ("timeouts", "connect_s"),
    ("timeouts", "first_byte_s"),
    ("timeouts", "total_s"),
    ("retry", "backoff_initial_s"),
    ("retry", "backoff_multiplier"),
    ("retry", "backoff_max_s"),
    ("admission", "queue_timeout_s"),
    ("admission", "retry_after_s"),
    ("health", "interval_s"),
    ("memory", "trim_interval_s"),
    ("health", "timeout_s"),
    ("circuit_breaker", "open_s"),
    ("load_poll", "interval_s"),
    ("load_poll", "timeout_s"),
    ("ready_timeout_s",),
    ("events", "snapshot_timeout_s"),
    ("events", "subscriber", "replay_timeout_s"),
    ("events", "subscriber", "replay_total_timeout_s"),
    ("events", "subscriber", "reconnect_interval_s"),
    ("events", "subscriber", "reconnect_interval_max_s"),
    ("sessions", "idle_timeout_s"),
    ("sessions", "reap_interval_s"),
    ("sessions", "refresh_fraction"),
    ("sessions", "local_cache_ttl_s"),
    ("sessions", "connect_timeout_s"),
    ("sessions", "command_timeout_s"),
    ("sessions", "reconnect_interval_s"),
    ("index", "prune_target_ratio"),
    ("index", "approx_ttl_s"),
    ("policy", "max_extra_ttft_s"),
    ("policy", "max_ttft_ratio"),
    ("policy", "move_tail_quantile"),
    ("policy", "resident_idle_s"),
    ("policy", "inner", "prefill_linear_tokens_per_s"),
    ("policy", "inner", "prefill_quadratic_tokens_sq_per_s"),
    ("policy", "inner", "per_waiting_request_s"),
    ("policy", "inner", "per_running_request_s"),
    ("policy", "inner", "overhead_s"),
    ("policy", "inner", "host_bandwidth_bytes_per_s"),
    ("policy", "inner", "pool_bandwidth_bytes_per_s"),
    ("policy", "inner", "recompute_penalty"),
    ("policy", "inner", "decode_penalty"),
    ("policy", "inner", "decode_s_per_sequence"),
    ("policy", "inner", "kv_read_bytes_per_s"),
    ("policy", "inner", "temperature"),
    ("policy", "inner", "max_kv_usage"),
    ("policy", "inner", "calibration_alpha"),
    ("policy", "inner", "min_speed_factor"),
    ("policy", "inner", "max_speed_factor"),
    ("policy", "inner", "min_calibration_work_s"),
    ("discovery", "watch_timeout_s"),
    ("discovery", "backoff_initial_s"),
    ("discovery", "backoff_max_s"),
    ("tracing", "sample_ratio"),
    ("pool_watch", "lease_ttl_s"),
    ("pool_watch", "interval_s"),
    ("pool_watch", "entry_ttl_s"),
    ("pool_watch", "request_timeout_s"),
    ("pool_watch", "decision_check_budget_s"),
]
"""Every float key of the gateway's YAML, as a path from the top (``test_float_keys_are_all_listed`` keeps it
complete)."""


def key_path(key: tuple[str | int, ...]) -> str:
    """``("models", 0, "x")`` -> ``$.models[0].x``, as the loader names it."""
    return "$" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in key)


def base_config(port: int) -> dict[str, Any]:
    """A config ``kvgate serve`` would start (on ``port``) with a section for every float key."""
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": "m", "block_size": 16}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:1", "model": "m"}],
        "events": {"subscriber": {}},
        "sessions": {},
        "index": {},
        "policy": {"name": "session_sticky", "inner": {"name": "cache_aware"}},
        "admin": {"disable_auth": True},
    }


def with_value(raw: dict[str, Any], key: tuple[str | int, ...], value: float) -> dict[str, Any]:
    node: Any = raw
    for part in key[:-1]:
        if isinstance(node, dict) and part not in node:
            node[part] = ({"label_selector": "app=vllm"} if part == "discovery"
                          else {"admin_url": "http://127.0.0.1:1"} if part == "pool_watch" else {})
        node = node[part]
    node[key[-1]] = value
    return raw


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS, ids=key_path)
def test_serve_refuses_a_non_finite_float_naming_the_key(tmp_path: Path, held_port: int,
                                                         caplog: pytest.LogCaptureFixture,
                                                         key: tuple[str | int, ...], value: float) -> None:
    path = tmp_path / "gateway.yaml"
    text = yaml.safe_dump(with_value(base_config(held_port), key, value))
    assert {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[str(value)] in text  # YAML's own spelling
    path.write_text(text, encoding="utf-8")
    with caplog.at_level(logging.INFO):
        status = main(["serve", "--config", str(path)])
    assert status == 2
    errors = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [("router.serve", f"config: Expected a finite number, got {value} - at `{key_path(key)}`")]


def test_the_base_config_starts_past_loading(tmp_path: Path, held_port: int,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The refusals above come from the values: without them the same file loads (and then fails only on the held
    listen port)."""
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(base_config(held_port)), encoding="utf-8")
    with caplog.at_level(logging.INFO):
        assert main(["serve", "--config", str(path)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"cannot listen on 127.0.0.1:{held_port}: address already in use "
                      "(another process holds it; pick another listen.port or --port)"]


def _float_fields(cls: type, prefix: tuple[str | int, ...]) -> set[tuple[str | int, ...]]:
    """The paths of the float fields of a struct type, nested structs followed (a tuple of structs as ``[0]``)."""
    out: set[tuple[str | int, ...]] = set()
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        types = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for t in types:
            if isinstance(t, msgspec.inspect.FloatType):
                out.add((*prefix, field.encode_name))
            elif isinstance(t, msgspec.inspect.StructType):
                out |= _float_fields(t.cls, (*prefix, field.encode_name))
            elif isinstance(t, msgspec.inspect.VarTupleType) and isinstance(t.item_type, msgspec.inspect.StructType):
                out |= _float_fields(t.item_type.cls, (*prefix, field.encode_name, 0))
    return out


def test_float_keys_are_all_listed() -> None:
    """A float key added to any section must be added to ``FLOAT_KEYS`` (and so be checked)."""
    found = ({key for key in _float_fields(GatewayConfig, ()) if key[0] != "policy"}  # any policy, at the top
             | _float_fields(SubscriberConfig, ("events", "subscriber"))
             | _float_fields(SessionsConfig, ("sessions",))
             | _float_fields(IndexConfig, ("index",))
             | (_float_fields(SessionStickyConfig, ("policy",)) - {("policy", "inner")})
             | _float_fields(CacheAwareConfig, ("policy", "inner"))
             | _float_fields(DiscoveryConfig, ("discovery",)))
    assert sorted(map(key_path, found)) == sorted(map(key_path, FLOAT_KEYS))


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: TimeoutsConfig(first_byte_s=NAN), ValueError, "first_byte_s must be a finite number, got nan"),
    (lambda: TimeoutsConfig(connect_s=INF), ValueError, "connect_s must be a finite number, got inf"),
    (lambda: HealthConfig(interval_s=NAN), ValueError, "interval_s must be a finite number, got nan"),
    (lambda: RetryConfig(backoff_multiplier=NAN), ValueError, "backoff_multiplier must be a finite number, got nan"),
    (lambda: RetryConfig(backoff_max_s=INF), ValueError, "backoff_max_s must be a finite number, got inf"),
    (lambda: ModelConfig(name="m", pending_blocks_ttl_s=NAN), ValueError,
     "pending_blocks_ttl_s must be a finite number, got nan"),
    (lambda: ModelConfig(name="m", prompt_cache_idle_s=INF), ValueError,
     "prompt_cache_idle_s must be a finite number, got inf"),
    (lambda: WorkerConfig(id="w", url="http://h:1", model="m", time_scale=-INF), ValueError,
     "time_scale must be a finite number, got -inf"),
    (lambda: EventsConfig(subscriber=SubscriberConfig(replay_timeout_s=INF)), ValueError,
     "subscriber: replay_timeout_s must be a finite number, got inf"),
    (lambda: SessionsConfig(idle_timeout_s=INF), SessionConfigError,
     "sessions.idle_timeout_s: must be a finite number of seconds, got inf"),
    (lambda: SessionsConfig(reap_interval_s=NAN), SessionConfigError,
     "sessions.reap_interval_s: must be a finite number of seconds, got nan"),
    (lambda: IndexConfig(approx_ttl_s=INF), IndexConfigError, "approx_ttl_s must be a finite number, got inf"),
    (lambda: IndexConfig(approx_ttl_s=NAN), IndexConfigError, "approx_ttl_s must be a finite number, got nan"),
])
def test_structs_built_in_code_refuse_non_finite_values(build: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


def test_finite_values_still_load() -> None:
    assert TimeoutsConfig(connect_s=0.5, first_byte_s=1e9, total_s=1e9).total_s == 1e9
    assert RetryConfig(backoff_multiplier=1.0).backoff_s(3) == 0.01
    assert math.isclose(SessionsConfig(idle_timeout_s=1e-3).idle_timeout_s, 1e-3)


@pytest.mark.parametrize(("body", "message"), [
    (b'{"name": "cache_aware", "max_speed_factor": 1e999}', "policy.max_speed_factor: Number out of range"),
    (b'{"name": "session_sticky", "max_ttft_ratio": -1e400}', "policy.max_ttft_ratio: Number out of range"),
    (b'{"name": "cache_aware", "temperature": NaN}',
     "policy: invalid JSON: JSON is malformed: invalid character (byte 39)"),
])
def test_policy_json_cannot_carry_a_non_finite_float(body: bytes, message: str) -> None:
    """``PUT /admin/policy`` decodes JSON, where NaN and infinities cannot be written (an overflowing literal is
    refused), so only the YAML path needs the check above."""
    with pytest.raises(PolicyConfigError) as info:
        decode_policy_config(body)
    assert str(info.value) == message
