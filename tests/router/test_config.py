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
        ({"events": {"subscriber": {"replay_total_timeout_s": 0}}},
         "Expected `float` > 0.0 - at `$.events.subscriber.replay_total_timeout_s`"),
        ({"events": {"subscriber": {"replay_timeout": 2}}},
         "Object contains unknown field `replay_timeout` - at `$.events.subscriber`"),
        ({"bogus": 1}, "unknown field `bogus`"),
        ({"health": {"interval_s": 0}}, "config: Expected `float` > 0.0 - at `$.health.interval_s`"),
        ({"admission": {"queue_size": -1}}, "config: Expected `int` >= 0 - at `$.admission.queue_size`"),
        ({"retry": {"backoff_multiplier": 0.5}}, "config: Expected `float` >= 1.0 - at `$.retry.backoff_multiplier`"),
        ({"models": [{"name": "m", "block_size": 0}]}, "config: Expected `int` >= 1 - at `$.models[0].block_size`"),
        ({"listen": {"port": 70000}}, "config: Expected `int` <= 65535 - at `$.listen.port`"),
        ({"policy": {"name": "nope"}}, "unknown policy 'nope'"),
        ({"policy": {"name": "nope"}}, "- at `$.policy.name`"),
        ({"policy": {"name": "session_sticky", "inner": {"name": "cache_aware", "temperature": -1}}},
         "Expected `float` >= 0.0 - at `$.policy.inner.temperature`"),
        ({"sessions": {"idle_timeout_s": 0}}, "Expected `float` > 0.0 - at `$.sessions.idle_timeout_s`"),
        ({"index": {"max_blocks": 0}}, "Expected `int` >= 1 - at `$.index.max_blocks`"),
        ({"index": {"groups": [{"kind": "full"}, {"kind": "sliding_window"}]}},
         "a sliding_window group needs sliding_window_tokens > 0 - at `$.index.groups[1]`"),
        ({"discovery": {"label_selector": "a=b", "worker": {"dp_ranks": 0}}},
         "discovery.worker: dp_ranks must be in 1..256, got 0 - at `$.discovery`"),
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


# --- one key style: snake_case, with the old kebab-case keys still accepted for one release -----------------------

OLD_STYLE = {
    "events": {"subscriber": {"replay-timeout-s": 3.5, "max-replay-batches": 7, "bind-topic-prefix": "kv@"}},
    "index": {"max-blocks": 1000, "approx-ttl-s": 5.0,
              "groups": [{"kind": "full"}, {"kind": "sliding_window", "sliding-window-tokens": 64},
                         {"kind": "sliding_window", "sliding-window-tokens": 128}]},
}
NEW_STYLE = {
    "events": {"subscriber": {"replay_timeout_s": 3.5, "max_replay_batches": 7, "bind_topic_prefix": "kv@"}},
    "index": {"max_blocks": 1000, "approx_ttl_s": 5.0,
              "groups": [{"kind": "full"}, {"kind": "sliding_window", "sliding_window_tokens": 64},
                         {"kind": "sliding_window", "sliding_window_tokens": 128}]},
}


def _deprecations(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "router.config" and r.levelname == "WARNING"]


def test_old_kebab_case_keys_load_as_their_snake_case_keys_with_one_warning_each(caplog):
    base = {"models": [{"name": "m"}], "admin": {"token": "t"}}
    with caplog.at_level("WARNING"):
        old = parse_config({**base, **OLD_STYLE})
    assert old == parse_config({**base, **NEW_STYLE})
    assert old.events.subscriber.replay_timeout_s == 3.5 and old.events.subscriber.max_replay_batches == 7
    assert old.index.max_blocks == 1000 and [g.sliding_window_tokens for g in old.index.groups] == [None, 64, 128]
    template = "config: key {} is deprecated and will be refused in the next release; write {} instead"
    assert _deprecations(caplog) == [template.format(old, new) for old, new in (
        ("events.subscriber.replay-timeout-s", "events.subscriber.replay_timeout_s"),
        ("events.subscriber.max-replay-batches", "events.subscriber.max_replay_batches"),
        ("events.subscriber.bind-topic-prefix", "events.subscriber.bind_topic_prefix"),
        ("index.max-blocks", "index.max_blocks"),
        ("index.approx-ttl-s", "index.approx_ttl_s"),
        ("index.groups[].sliding-window-tokens", "index.groups[].sliding_window_tokens"),  # two groups: one warning
    )]


def test_new_style_keys_log_no_deprecation(caplog):
    with caplog.at_level("WARNING"):
        parse_config({"models": [{"name": "m"}], "admin": {"token": "t"}, **NEW_STYLE})
    assert _deprecations(caplog) == []


def test_an_old_and_a_new_spelling_of_one_key_are_refused(caplog):
    raw = {"models": [{"name": "m"}], "admin": {"token": "t"},
           "index": {"max-blocks": 10, "max_blocks": 20}}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert str(info.value) == "config: Object contains unknown field `max-blocks` - at `$.index`"


def test_a_kebab_case_key_that_names_no_field_is_unknown(caplog):
    raw = {"models": [{"name": "m"}], "admin": {"token": "t"}, "listen": {"max-body": 1}}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert str(info.value) == "config: Object contains unknown field `max-body` - at `$.listen`"
    assert _deprecations(caplog) == []


def test_old_keys_under_a_yaml_alias_are_renamed_wherever_the_alias_is_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    path = tmp_path / "gateway.yaml"
    path.write_text("models: [{name: m}]\n"
                    "index: {groups: [{kind: full}, &w {kind: sliding_window, sliding-window-tokens: 32}, *w]}\n",
                    encoding="utf-8")
    with caplog.at_level("WARNING"):
        config = load_config(path)
    assert [g.sliding_window_tokens for g in config.index.groups] == [None, 32, 32]
    assert len(_deprecations(caplog)) == 1


def test_the_policy_section_decodes_like_put_admin_policy():
    from policies import decode_policy_config

    section = {"name": "session_sticky", "max_extra_ttft_s": 0.25, "inner": {"name": "cache_aware", "seed": 3}}
    config = parse_config({"models": [{"name": "m"}], "admin": {"token": "t"}, "policy": section})
    assert config.policy == decode_policy_config(section) == decode_policy_config(
        b'{"name": "session_sticky", "max_extra_ttft_s": 0.25, "inner": {"name": "cache_aware", "seed": 3}}')
