"""``models[].pd`` and ``workers[].role`` in the gateway config: defaults, and errors that name the key."""

from __future__ import annotations

import pytest

from router.config import parse_config
from router.errors import ConfigError

pytestmark = pytest.mark.unit


def raw(model_pd: object = None, **worker: object) -> dict[str, object]:
    model: dict[str, object] = {"name": "m"}
    if model_pd is not None:
        model["pd"] = model_pd
    return {"models": [model], "workers": [{"id": "w", "url": "http://127.0.0.1:9", "model": "m", **worker}],
            "admin": {"token": "t"}}


def test_defaults_and_values():
    cfg = parse_config(raw())
    assert cfg.models[0].pd is None and cfg.workers[0].role == "both" and cfg.workers[0].bootstrap_port is None
    cfg = parse_config(raw({"protocol": "sglang", "queue_timeout_s": 2}, role="prefill", bootstrap_port=8998))
    pd = cfg.models[0].pd
    assert pd is not None and pd.protocol == "sglang" and pd.queue_timeout_s == 2.0
    assert pd.transfer().link_bytes_per_s == 25e9
    assert (cfg.workers[0].role, cfg.workers[0].bootstrap_port) == ("prefill", 8998)


@pytest.mark.parametrize(
    ("config", "names"),
    [
        (raw({"protocol": "nixl"}), "protocol"),
        (raw({"max_reserved_fraction": 0}), "max_reserved_fraction"),
        (raw({"unknown": 1}), "unknown"),
        (raw(role="router"), "role"),
        (raw(bootstrap_port=70000), "bootstrap_port"),
    ],
)
def test_bad_values_name_their_key(config, names):
    with pytest.raises(ConfigError, match=names):
        parse_config(config)
