"""Pod -> worker mapping, the discovery config's validation and the namespace lookup (no sockets)."""

from __future__ import annotations

import pytest

from router.config import WorkerConfig
from router.discovery import DiscoveryConfig, decode_discovery_config, pod_to_worker, resolve_namespace
from router.errors import ConfigError
from tests.discovery.fake_apiserver import make_pod

pytestmark = pytest.mark.unit


def make_config(**overrides: object) -> DiscoveryConfig:
    return decode_discovery_config({"label_selector": "app=worker", "model": "llama", **overrides})


def test_ready_pod_becomes_worker_with_every_endpoint():
    config = make_config(port=8001, events_port=5557, replay_port=5558)
    worker = pod_to_worker(config, make_pod("w-0", "10.1.2.3"))
    assert worker == WorkerConfig(id="w-0", url="http://10.1.2.3:8001", model="llama",
                                  events_endpoint="tcp://10.1.2.3:5557", replay_endpoint="tcp://10.1.2.3:5558")


@pytest.mark.parametrize("pod", [
    make_pod("w", is_ready=False),
    make_pod("w", phase="Pending"),
    make_pod("w", phase="Succeeded"),
    make_pod("w", is_deleting=True),
    make_pod("w", ip=""),
    {"metadata": {"name": "w"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}},  # no conditions yet
], ids=["not-ready", "pending", "succeeded", "deleting", "no-ip", "no-conditions"])
def test_pod_that_is_not_routable_is_no_worker(pod):
    assert pod_to_worker(make_config(), pod) is None


def test_model_from_label_then_annotation_then_default():
    config = make_config(model_label="kvgate.io/model", model_annotation="kvgate.io/model")
    both = make_pod("w", labels={"kvgate.io/model": "from-label"}, annotations={"kvgate.io/model": "from-ann"})
    annotated = make_pod("w", annotations={"kvgate.io/model": "from-ann"})
    assert pod_to_worker(config, both).model == "from-label"
    assert pod_to_worker(config, annotated).model == "from-ann"
    assert pod_to_worker(config, make_pod("w")).model == "llama"


def test_pod_naming_no_model_without_default_is_skipped():
    config = make_config(model="", model_label="kvgate.io/model")
    assert pod_to_worker(config, make_pod("w")) is None


def test_port_annotation_overrides_port_and_bad_value_skips_pod():
    config = make_config(port=8000, port_annotation="kvgate.io/port")
    assert pod_to_worker(config, make_pod("w", "10.0.0.9", annotations={"kvgate.io/port": "9001"})).url == (
        "http://10.0.0.9:9001")
    assert pod_to_worker(config, make_pod("w", "10.0.0.9")).url == "http://10.0.0.9:8000"
    assert pod_to_worker(config, make_pod("w", annotations={"kvgate.io/port": "http"})) is None
    assert pod_to_worker(config, make_pod("w", annotations={"kvgate.io/port": "70000"})) is None


def test_ipv6_pod_ip_is_bracketed():
    worker = pod_to_worker(make_config(port=8000), make_pod("w", "fd00::12"))
    assert (worker.url, worker.events_endpoint) == ("http://[fd00::12]:8000", "tcp://[fd00::12]:5557")


def test_no_events_port_means_approximate_mode():
    worker = pod_to_worker(make_config(events_port=None), make_pod("w", "10.0.0.1"))
    assert worker.events_endpoint is None
    assert worker.has_events is False


def test_worker_keys_apply_to_every_discovered_worker():
    config = make_config(worker={"pools": ["MOONCAKE"], "dp_ranks": 2, "load_path": None})
    worker = pod_to_worker(config, make_pod("w", "10.0.0.1"))
    assert (worker.pools, worker.dp_ranks, worker.load_path, worker.snapshot_path) == (
        ("MOONCAKE",), 2, None, "/kv/snapshot")


@pytest.mark.parametrize(("section", "fragment"), [
    ({"label_selector": " "}, "label_selector must not be empty"),
    ({}, "label_selector"),
    ({"label_selector": "a=b", "worker": {"url": "http://x"}}, "url come from the pod"),
    ({"label_selector": "a=b", "worker": {"dp_ranks": 0}}, "discovery.worker"),
    ({"label_selector": "a=b", "worker": {"colour": "red"}}, "colour"),
    ({"label_selector": "a=b", "backoff_initial_s": 5, "backoff_max_s": 1}, "backoff_max_s"),
    ({"label_selector": "a=b", "port": 0}, "port"),
    ({"label_selector": "a=b", "kind": "consul"}, "kind"),
    ({"label_selector": "a=b", "selector": "x"}, "selector"),
])
def test_bad_discovery_section_names_the_key(section, fragment):
    with pytest.raises(ConfigError) as info:
        decode_discovery_config(section)
    assert fragment in info.value.message
    assert info.value.message.startswith("discovery")


def test_gateway_config_validates_discovery_at_load():
    from router.config import parse_config

    base = {"models": [{"name": "llama"}], "admin": {"token": "t"}, "policy": {"name": "round_robin"}}
    assert parse_config({**base, "discovery": {"label_selector": "app=w"}}).discovery == decode_discovery_config(
        {"label_selector": "app=w"})
    assert parse_config(base).discovery is None
    with pytest.raises(ConfigError, match="discovery"):
        parse_config({**base, "discovery": {"label_selector": "app=w", "port": "http"}})


def test_namespace_from_config_then_env_then_service_account(tmp_path):
    ns_file = tmp_path / "namespace"
    ns_file.write_text("from-file\n")
    missing = str(tmp_path / "missing")
    assert resolve_namespace(make_config(namespace="cfg"), {"POD_NAMESPACE": "env"}, str(ns_file)) == "cfg"
    assert resolve_namespace(make_config(), {"POD_NAMESPACE": "env"}, str(ns_file)) == "env"
    assert resolve_namespace(make_config(), {}, str(ns_file)) == "from-file"
    with pytest.raises(ConfigError, match="no namespace"):
        resolve_namespace(make_config(), {}, missing)
