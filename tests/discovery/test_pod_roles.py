"""Disaggregated roles from pod labels and SGLang's bootstrap-port annotation (no sockets)."""

from __future__ import annotations

import pytest

from router.discovery import decode_discovery_config, pod_to_worker
from tests.discovery.fake_apiserver import make_pod

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("labels", "annotations", "want"),
    [
        ({"kvgate.io/role": "prefill"}, {"sglang.ai/bootstrap-port": "8998"}, ("prefill", 8998)),
        ({"kvgate.io/role": "decode"}, {}, ("decode", None)),
        ({}, {}, ("both", None)),
        ({"kvgate.io/role": "router"}, {"sglang.ai/bootstrap-port": "not-a-port"}, ("both", None)),
    ],
    ids=["prefill-with-bootstrap", "decode", "no-label", "unknown-role-bad-port"],
)
def test_role_label_and_bootstrap_annotation(labels, annotations, want):
    config = decode_discovery_config({"label_selector": "app=worker", "model": "llama"})
    worker = pod_to_worker(config, make_pod("w", "10.0.0.9", labels=labels, annotations=annotations))
    assert worker is not None and (worker.role, worker.bootstrap_port) == want


def test_role_label_can_be_renamed_and_is_not_settable_for_all_workers():
    config = decode_discovery_config({"label_selector": "app=worker", "model": "llama", "role_label": "tier"})
    worker = pod_to_worker(config, make_pod("w", labels={"tier": "decode"}))
    assert worker is not None and worker.role == "decode"
    with pytest.raises(Exception, match="role"):
        decode_discovery_config({"label_selector": "app=worker", "worker": {"role": "decode"}})
