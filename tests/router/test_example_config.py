"""``deploy/gateway.example.yaml`` says that every value it shows is the default unless marked ``example``: hold it
to that, section by section, against the config structs' own defaults."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from policies import decode_policy_config
from policies.config import CacheAwareConfig, SessionStickyConfig
from router.config import (
    AdminConfig,
    AdmissionConfig,
    CircuitBreakerConfig,
    EventsConfig,
    GatewayConfig,
    HealthConfig,
    ListenConfig,
    LoadPollConfig,
    MemoryConfig,
    ModelConfig,
    RetryConfig,
    TimeoutsConfig,
    WorkerConfig,
    load_config,
    validate_sessions,
)
from router.sessions.config import SessionsConfig
from router.tracing_config import TracingConfig

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "gateway.example.yaml"


@pytest.fixture
def example(monkeypatch) -> GatewayConfig:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    return load_config(EXAMPLE)


def test_header_states_the_rule_checked_here():
    header = EXAMPLE.read_text(encoding="utf-8").splitlines()[1:3]
    assert header == [
        "# Every key is optional unless marked required. A value marked `example` is an example (a required key has no",
        "# default); every other value shown is the default. Unknown keys are refused, and an error names the key path",
    ]


def test_sections_show_the_defaults(example):
    assert example.listen == ListenConfig()
    assert example.events == EventsConfig()
    assert example.timeouts == TimeoutsConfig()
    assert example.retry == RetryConfig()
    assert example.admission == AdmissionConfig()
    assert example.health == HealthConfig()
    assert example.circuit_breaker == CircuitBreakerConfig()
    assert example.load_poll == LoadPollConfig()
    assert example.admin == AdminConfig()
    assert example.tracing == TracingConfig()
    assert example.memory == MemoryConfig()
    assert example.endpoint_picker is None
    assert example.pool_watch is None
    defaults = GatewayConfig(models=(ModelConfig(name="m"),))
    assert (example.ready_timeout_s, example.index, example.session_key_sources, example.discovery) == (
        defaults.ready_timeout_s, defaults.index, defaults.session_key_sources, defaults.discovery
    )


def test_model_shows_the_defaults_besides_its_example_name(example):
    [model] = example.models
    assert model == ModelConfig(name="llama-3-8b")


def test_worker_shows_the_defaults_besides_its_example_keys(example):
    [worker] = example.workers
    examples = {"id": "w0", "url": "http://127.0.0.1:8001", "model": "llama-3-8b",
                "events_endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5567"}
    assert worker == WorkerConfig(**examples)


def test_policy_shown_is_the_default_policy(example):
    default = GatewayConfig(models=(ModelConfig(name="m"),)).policy
    assert decode_policy_config(example.policy) == decode_policy_config(default)
    assert decode_policy_config(example.policy) == SessionStickyConfig(inner=CacheAwareConfig())
    assert example.policy.inner.max_kv_usage is None


def test_sessions_shown_are_the_defaults(example):
    assert validate_sessions(example.sessions) == SessionsConfig()


def test_every_shown_key_exists(example):
    """Keys the example lists are real keys: decoding the raw YAML refuses unknown ones, and nothing is dropped."""
    raw = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    assert sorted(raw) == sorted(msgspec.structs.asdict(example))
