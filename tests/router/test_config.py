"""Config decoding: the documented example loads, and errors name the key and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import load_config, parse_config
from router.errors import ConfigError

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "gateway.example.yaml"


def test_example_config_loads(monkeypatch):
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = load_config(EXAMPLE)
    assert config.workers[0].id == "w0" and config.timeouts.first_byte_s == 300.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"listen": {"port": "x"}}, "Expected `int`, got `str` - at `$.listen.port`"),
        ({"timeouts": {"connect_s": 0}}, "connect_s must be > 0"),
        ({"listen": {"body_timeout_s": 0}}, "body_timeout_s must be > 0"),
        ({"events": {"subscriber": {"replay-total-timeout-s": 0}}},
         "subscriber: Expected `float` > 0.0 - at `$.replay-total-timeout-s`"),
        ({"events": {"subscriber": {"replay-timeout": 2}}}, "subscriber: Object contains unknown field"),
        ({"bogus": 1}, "unknown field `bogus`"),
        ({"policy": {"name": "nope"}}, "policy:"),
        ({"admin": {}}, "admin: no token"),
        ({"workers": [{"id": "a", "url": "http://x", "model": "other"}]}, "unknown model 'other'"),
    ],
)
def test_errors_name_the_key(monkeypatch, overrides, message):
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN", raising=False)
    raw = {"models": [{"name": "m"}], "admin": {"token": "t"}, **overrides}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert message in str(info.value)
