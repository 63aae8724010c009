"""The ``sessions:`` config: decoding, validation naming the key, secrets resolved and never shown."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from router.sessions.config import SessionsConfig, redact_url, resolve_redis_target
from router.sessions.errors import SessionConfigError
from router.sessions.factory import build_session_store
from router.sessions.memory import MemorySessionStore

pytestmark = pytest.mark.unit


def decode(text: str) -> SessionsConfig:
    return msgspec.convert(yaml.safe_load(text), SessionsConfig)


def test_decode_yaml_and_defaults() -> None:
    config = decode("store: redis\nurl: redis://127.0.0.1:7000/2\nkey_prefix: 'fleet-a:'\nidle_timeout_s: 60\n")
    assert config.store == "redis"
    assert config.idle_timeout_s == 60.0
    assert config.key_prefix == "fleet-a:"
    assert config.refresh_fraction == 0.1
    assert config.enable_local_cache is False
    assert SessionsConfig().store == "memory"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("idle_timeout_s: 0", "idle_timeout_s"),
        ("refresh_fraction: 1.5", "refresh_fraction"),
        ("url: http://127.0.0.1:6379", "url"),
        ("url: 'redis://:hunter2@127.0.0.1:6379/0'", "url"),
        ("url_env: A\nurl_file: /b", "url_env"),
        ("key_prefix: ''", "key_prefix"),
    ],
)
def test_invalid_values_name_the_key(text: str, key: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        decode(text)
    # msgspec names range violations by path, __post_init__ checks by "sessions.<key>:"
    assert f"sessions.{key}:" in str(info.value) or f"at `$.{key}`" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_direct_construction_validates_too() -> None:
    with pytest.raises(SessionConfigError) as info:
        SessionsConfig(idle_timeout_s=-1.0)
    assert info.value.key == "idle_timeout_s"


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError, match="idle_timeout"):
        decode("idle_timeout: 5")


def test_secrets_from_env_and_file_are_redacted(tmp_path) -> None:
    secret_file = tmp_path / "pw"
    secret_file.write_text("s3cr3t-file\n")
    config = SessionsConfig(store="redis", url_env="KV_URL", password_file=str(secret_file))
    target = resolve_redis_target(config, {"KV_URL": "rediss://user:s3cr3t-url@127.0.0.1:6380/3?ssl_cert_reqs=none"})
    assert target.url.startswith("rediss://user:s3cr3t-url@")
    assert target.password == "s3cr3t-file"
    assert target.endpoint == "rediss://127.0.0.1:6380/3"
    for shown in (repr(target), str(target), repr(config)):
        assert "s3cr3t" not in shown


def test_missing_secret_sources_raise_config_error(tmp_path) -> None:
    with pytest.raises(SessionConfigError) as info:
        resolve_redis_target(SessionsConfig(store="redis", password_env="NOPE"), {})
    assert info.value.key == "password_env"
    with pytest.raises(SessionConfigError) as info:
        resolve_redis_target(SessionsConfig(store="redis", url_file=str(tmp_path / "missing")), {})
    assert info.value.key == "url_file"
    with pytest.raises(SessionConfigError) as info:
        resolve_redis_target(SessionsConfig(store="redis", url_env="U"), {"U": "http://:pw@x"})
    assert "pw" not in str(info.value)


def test_redact_url() -> None:
    assert redact_url("redis://:pw@127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("unix:///tmp/redis.sock?password=pw") == "unix:///tmp/redis.sock"


def test_build_memory_store_uses_injected_clock() -> None:
    store = build_session_store(SessionsConfig(idle_timeout_s=5.0, max_num_sessions=7), clock=lambda: 42.0)
    assert isinstance(store, MemorySessionStore)
    assert (store.idle_timeout_s, store.max_num_sessions) == (5.0, 7)
    assert store.claim_or_touch_sync("s", "w").last_used_s == 42.0
