"""values.schema.json against the gateway's config structs, and against a real helm.

The schema spells out the gateway YAML the chart renders (``gateway.models``, ``gateway.workers``,
``gateway.policy``, ``gateway.extraConfig``, ``discovery.worker``), so a misspelt key fails ``helm template`` /
``helm lint`` instead of crash-looping the pod (``kvgate serve`` exits 2 on it). The schema is written by hand;
the first tests derive every section's keys, JSON types, enums and ranges from the msgspec structs and compare,
so a key added to, renamed in or removed from a struct fails here until the schema follows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from events.subscriber import SubscriberConfig
from policies.config import (
    POLICY_NAMES,
    CacheAwareConfig,
    ConsistentHashConfig,
    LeastLoadedConfig,
    PowerOfTwoConfig,
    RandomConfig,
    RoundRobinConfig,
    SessionStickyConfig,
    encode_policy_config,
)
from router.config import (
    AdminConfig,
    AdmissionConfig,
    CircuitBreakerConfig,
    EventsConfig,
    GatewayConfig,
    HealthConfig,
    ListenConfig,
    LoadPollConfig,
    ModelConfig,
    RetryConfig,
    TimeoutsConfig,
    WorkerConfig,
    index_config,
    parse_config,
)
from router.discovery import _OWNED_WORKER_KEYS, DiscoveryConfig, decode_discovery_config
from router.index.config import GroupKind, GroupSpec, IndexConfig
from router.sessions.config import SessionsConfig
from tests.helm.test_chart import CHART, KUBE_VERSION, NAMESPACE, RELEASE, gateway_yaml, run_helm

SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
DEFS: dict[str, Any] = SCHEMA["definitions"]
SCHEMA_ERROR = "don't meet the specifications of the schema"

POLICIES: dict[str, type[msgspec.Struct]] = {
    "policyRoundRobin": RoundRobinConfig,
    "policyRandom": RandomConfig,
    "policyLeastLoaded": LeastLoadedConfig,
    "policyPowerOfTwo": PowerOfTwoConfig,
    "policyConsistentHash": ConsistentHashConfig,
    "policyCacheAware": CacheAwareConfig,
    "policySessionSticky": SessionStickyConfig,
}
STRUCTS: dict[str, type[msgspec.Struct]] = {
    "gatewayConfig": GatewayConfig,
    "model": ModelConfig,
    "worker": WorkerConfig,
    "listen": ListenConfig,
    "events": EventsConfig,
    "subscriber": SubscriberConfig,
    "timeouts": TimeoutsConfig,
    "retry": RetryConfig,
    "admission": AdmissionConfig,
    "health": HealthConfig,
    "circuitBreaker": CircuitBreakerConfig,
    "loadPoll": LoadPollConfig,
    "admin": AdminConfig,
    "index": IndexConfig,
    "indexGroup": GroupSpec,
    "sessions": SessionsConfig,
    "discovery": DiscoveryConfig,
    "discoveredWorker": WorkerConfig,
    **POLICIES,
}
"""Schema definition -> the struct that decodes that section in the gateway."""

LEFT_OUT = {
    "index": {"block_size"},  # taken from each model's block_size (router.config.index_config)
    "discoveredWorker": set(_OWNED_WORKER_KEYS),  # from the pod; the gateway refuses them in discovery.worker
}
"""Struct keys a section's schema leaves out on purpose (the gateway refuses or overrides them there)."""

DEPRECATED_SECTIONS = ("subscriber", "index", "indexGroup")
"""Sections whose kebab-case keys of earlier releases the gateway still accepts (with a warning), and so the schema."""

CARRIED = {
    ("gatewayConfig", "policy"): "policy",
    ("gatewayConfig", "sessions"): "sessions",
    ("gatewayConfig", "index"): "index",
    ("gatewayConfig", "discovery"): "discovery",
    ("events", "subscriber"): "subscriber",
    ("discovery", "worker"): "discoveredWorker",
}
"""Keys the struct types as a raw mapping that another struct decodes later -> that struct's schema definition."""

DEF_OF_STRUCT = {cls.__name__: name for name, cls in STRUCTS.items() if name != "discoveredWorker"}


def struct_keys(cls: type[msgspec.Struct]) -> set[str]:
    """The YAML keys of a struct: its fields as encoded (snake_case), and its tag field."""
    keys = {f.encode_name for f in msgspec.structs.fields(cls)}
    tag_field = cls.__struct_config__.tag_field
    return keys | {tag_field} if tag_field else keys


def resolve(schema: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """Follow this schema's ``$ref`` chain: (the last definition name or None, the schema it lands on)."""
    name = None
    while "$ref" in schema:
        name = schema["$ref"].removeprefix("#/definitions/")
        schema = DEFS[name]
    return name, schema


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}[type(value)]


def ours(schema: dict[str, Any]) -> dict[str, Any]:
    """Types, enum, numeric bounds and items of one of our property schemas."""
    _, schema = resolve(schema)
    enum = {schema["const"]} if "const" in schema else set(schema["enum"]) if "enum" in schema else None
    types = schema.get("type", [_json_type(v) for v in enum] if enum else [])
    return {"types": {types} if isinstance(types, str) else set(types), "enum": enum, "bounds": schema,
            "items": schema.get("items")}


def theirs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The same facts from msgspec's JSON schema of a field (anyOf branches merged, struct refs named)."""
    branches = schema["anyOf"] if "anyOf" in schema else [schema]
    out: dict[str, Any] = {"types": set(), "enum": None, "bounds": {}, "items": None, "structs": set()}
    for branch in branches:
        if "$ref" in branch:
            name = branch["$ref"].rsplit("/", 1)[1]
            target = defs[name]
            if target.get("type") == "object":
                out["types"].add("object")
                out["structs"].add(name)
                continue
            branch = target  # an Enum: its values
        if "enum" in branch:
            out["enum"] = set(branch["enum"])
            out["types"] |= {_json_type(v) for v in branch["enum"]}
        else:
            out["types"].add(branch["type"])
        if branch.get("type") in ("integer", "number"):
            out["bounds"] = branch
        if "items" in branch:
            out["items"] = branch["items"]
    return out


def _at_least_as_strict(our: dict[str, Any], their: dict[str, Any], side: str) -> bool:
    inclusive, exclusive = ("minimum", "exclusiveMinimum") if side == "low" else ("maximum", "exclusiveMaximum")
    if inclusive not in their and exclusive not in their:
        return True
    their_bound, their_open = (their[exclusive], True) if exclusive in their else (their[inclusive], False)
    if exclusive in our:
        our_bound, our_open = our[exclusive], True
    elif inclusive in our:
        our_bound, our_open = our[inclusive], False
    else:
        return False
    beyond = our_bound > their_bound if side == "low" else our_bound < their_bound
    return beyond or (our_bound == their_bound and (our_open or not their_open))


def compare_field(where: str, our_schema: dict[str, Any], their_schema: dict[str, Any],
                  their_defs: dict[str, Any]) -> list[str]:
    """What our schema of one key gets wrong against msgspec's (types, enum, bounds; items of arrays)."""
    our, their = ours(our_schema), theirs(their_schema, their_defs)
    problems = []
    if our["types"] != their["types"]:
        problems.append(f"{where}: types {sorted(our['types'])} != the struct's {sorted(their['types'])}")
    if their["enum"] is not None and our["enum"] != their["enum"]:
        problems.append(f"{where}: enum {our['enum']} != the struct's {their['enum']}")
    for side in ("low", "high"):
        if not _at_least_as_strict(our["bounds"], their["bounds"], side):
            problems.append(f"{where}: {side} bound looser than the struct's {their['bounds']}")
    wanted = {DEF_OF_STRUCT[s] for s in their["structs"] if s in DEF_OF_STRUCT}
    name, target = resolve(our_schema)
    if len(wanted) == 1 and name not in wanted:
        problems.append(f"{where}: must use #/definitions/{wanted.pop()}")
    if len(wanted) > 1 and {resolve(branch["then"])[0] for branch in target.get("allOf", ())} != wanted:
        problems.append(f"{where}: must be a union of {sorted(wanted)}")
    if their["items"] is not None:
        if our["items"] is None:
            problems.append(f"{where}: no items schema")
        else:
            problems += compare_field(f"{where}[]", our["items"], their["items"], their_defs)
    return problems


def current(definition: str) -> dict[str, Any]:
    """A section's properties without the deprecated spellings."""
    return {k: v for k, v in DEFS[definition]["properties"].items() if not v.get("deprecated")}


@pytest.mark.parametrize("definition", sorted(STRUCTS))
def test_section_keys_equal_the_struct_fields(definition):
    schema = DEFS[definition]
    assert schema["additionalProperties"] is False
    expected = struct_keys(STRUCTS[definition]) - LEFT_OUT.get(definition, set())
    assert set(current(definition)) == expected


@pytest.mark.parametrize("definition", sorted(STRUCTS))
def test_deprecated_keys_are_the_old_spellings_with_the_same_schema(definition):
    """The kebab-case keys of earlier releases stay valid for one release where the gateway still accepts them:
    each is the old spelling of a current key, with that key's schema."""
    properties = DEFS[definition]["properties"]
    deprecated = {k: v for k, v in properties.items() if v.get("deprecated")}
    if definition not in DEPRECATED_SECTIONS:
        assert deprecated == {}
        return
    assert set(deprecated) == {k.replace("_", "-") for k in current(definition) if "_" in k}
    for old, schema in deprecated.items():
        assert schema["allOf"] == [properties[old.replace("-", "_")]]


@pytest.mark.parametrize("definition", sorted(STRUCTS))
def test_section_types_enums_and_ranges_follow_the_struct(definition):
    cls = STRUCTS[definition]
    full = msgspec.json.schema(cls)
    their_defs = full["$defs"]
    their_props = their_defs[full["$ref"].rsplit("/", 1)[1]]["properties"]
    problems = []
    for key, our_schema in current(definition).items():
        if (definition, key) in CARRIED:
            if resolve(our_schema)[0] != CARRIED[(definition, key)]:
                problems.append(f"{key}: must use #/definitions/{CARRIED[(definition, key)]}")
            our_types = ours(our_schema)["types"]
            if our_types != theirs(their_props[key], their_defs)["types"]:
                problems.append(f"{key}: types {our_types}")
            continue
        problems += compare_field(key, our_schema, their_props[key], their_defs)
    assert problems == []


@pytest.mark.parametrize("definition", sorted(STRUCTS))
def test_required_keys_are_the_structs_at_most(definition):
    """The schema never requires what the gateway defaults; list entries require exactly what the struct does."""
    full = msgspec.json.schema(STRUCTS[definition])
    required = set(full["$defs"][full["$ref"].rsplit("/", 1)[1]].get("required", ()))
    ours_required = set(DEFS[definition].get("required", ()))
    if definition in ("model", "worker"):
        assert ours_required == required
    else:
        assert ours_required <= required


@pytest.mark.parametrize(("definition", "names"), [
    ("policy", set(POLICY_NAMES)),
    ("innerPolicy", set(POLICY_NAMES) - {"session_sticky"}),
])
def test_policy_union_dispatches_on_name_like_the_decoder(definition, names):
    schema = DEFS[definition]
    assert set(schema["properties"]["name"]["enum"]) == names
    dispatch = {branch["if"]["properties"]["name"]["const"]: resolve(branch["then"])[0] for branch in schema["allOf"]}
    expected = {str(cls.__struct_config__.tag): name for name, cls in POLICIES.items()}
    assert dispatch == {name: expected[name] for name in names}
    assert all(branch["if"]["required"] == ["name"] for branch in schema["allOf"])


def test_chart_values_use_the_gateway_sections():
    gateway = SCHEMA["properties"]["gateway"]["properties"]
    assert resolve(gateway["models"]["items"])[0] == "model"
    assert resolve(gateway["workers"]["items"])[0] == "worker"
    assert resolve(gateway["policy"])[0] == "policy"
    assert resolve(gateway["extraConfig"])[0] == "gatewayConfig"
    assert resolve(SCHEMA["properties"]["discovery"]["properties"]["worker"])[0] == "discoveredWorker"
    assert resolve(DEFS["policySessionSticky"]["properties"]["inner"])[0] == "innerPolicy"


# --- with a real helm --------------------------------------------------------------------------------------------

HELMS = ("helm4", "helm3")


def _write(tmp: Path, values: dict[str, Any]) -> Path:
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return path


def _render_args(command: str, values_file: Path) -> list[str]:
    if command == "template":
        return ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                "-f", str(values_file)]
    return ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
            "-f", str(values_file)]


TYPOS = [  # (values, the key the error must name) - the two from the bug report first
    pytest.param({"gateway": {"models": [{"name": "m", "blocksize": 32}]}}, "blocksize", id="models-blocksize"),
    pytest.param({"gateway": {"extraConfig": {"timeouts": {"conect_s": 2}}}}, "conect_s", id="timeouts-conect_s"),
    pytest.param({"gateway": {"policy": {"inner": {"temperatur": 0.1}}}}, "temperatur", id="policy-inner-key"),
    pytest.param({"gateway": {"extraConfig": {"events": {"subscriber": {"replay_timout_s": 1}}}}},
                 "replay_timout_s", id="subscriber-key"),
    pytest.param({"gateway": {"extraConfig": {"index": {"block_size": 32}}}}, "block_size", id="index-block-size"),
    pytest.param({"gateway": {"extraConfig": {"index": {"block-size": 32}}}}, "block-size", id="index-old-block-size"),
    pytest.param({"gateway": {"extraConfig": {"sesions": {"max_num_sessions": 10}}}}, "sesions", id="top-level"),
    pytest.param({"gateway": {"workers": [{"id": "w", "url": "http://w:8000", "model": "m", "event_endpoint": "x"}]}},
                 "event_endpoint", id="workers-key"),
    pytest.param({"discovery": {"worker": {"url": "http://x:1"}}}, "url", id="discovery-worker-owned-key"),
    pytest.param({"gateway": {"policy": {"name": "cache_aware"}}}, "inner", id="policy-switch-keeps-default-inner"),
]


@pytest.mark.integration
@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("command", ["template", "lint"])
@pytest.mark.parametrize(("values", "key"), TYPOS)
def test_misspelt_gateway_key_fails_naming_it(tmp_path, helm, command, values, key):
    result = run_helm(_render_args(command, _write(tmp_path, values)), tmp_path, helm)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert SCHEMA_ERROR in output
    assert key in output


BAD_VALUES = [  # (values, a word the error names)
    pytest.param({"gateway": {"models": [{"name": "m", "block_size": 0}]}}, "block_size", id="block-size-0"),
    pytest.param({"gateway": {"models": [{"name": "m", "block_size": "16"}]}}, "block_size", id="block-size-str"),
    pytest.param({"gateway": {"extraConfig": {"retry": {"max_retries": -1}}}}, "max_retries", id="negative"),
    pytest.param({"gateway": {"extraConfig": {"timeouts": {"connect_s": 0}}}}, "connect_s", id="zero-timeout"),
    pytest.param({"gateway": {"extraConfig": {"sessions": {"store": "disk"}}}}, "store", id="sessions-store"),
    pytest.param({"gateway": {"extraConfig": {"index": {"groups": [{"kind": "sliding_window"}]}}}},
                 "sliding_window_tokens", id="sliding-window-needs-tokens"),
    pytest.param({"gateway": {"policy": {"inner": {"name": "session_sticky"}}}}, "name", id="sticky-inside-sticky"),
    pytest.param({"gateway": {"policy": {"key_sources": ["cookie"]}}}, "key_sources", id="key-source"),
    pytest.param({"gateway": {"extraConfig": {"listen": {"max_body_bytes": 1.5}}}}, "max_body_bytes",
                 id="float-for-int"),
    pytest.param({"gateway": {"workers": [{"id": "w0", "url": "http://w0:8000", "model": "m",
                                           "health_path": "health"}]}}, "health_path", id="path-without-slash"),
    pytest.param({"discovery": {"worker": {"load_path": "load"}}}, "load_path", id="discovered-path-without-slash"),
    pytest.param({"gateway": {"workers": [{"id": "w0", "url": "http://w0:8000", "model": "m", "pools": ["CPU"]}]}},
                 "pools", id="worker-tier-as-pool"),
]


@pytest.mark.integration
@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(("values", "key"), BAD_VALUES)
def test_bad_gateway_value_fails_the_render(tmp_path, helm, values, key):
    result = run_helm(_render_args("template", _write(tmp_path, values)), tmp_path, helm)
    assert result.returncode != 0, result.stdout
    assert SCHEMA_ERROR in result.stderr
    assert key in result.stderr


@pytest.mark.integration
@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", [None, *sorted(p.name for p in (CHART / "examples").glob("*.yaml"))])
def test_defaults_and_examples_render(tmp_path, helm, values):
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values:
        args += ["-f", str(CHART / "examples" / values)]
    result = run_helm(args, tmp_path, helm)
    assert result.returncode == 0, result.stderr


def _plain(value: Any) -> Any:
    """A struct (or anything msgspec encodes) as JSON builtins: every field, tuples as lists."""
    return json.loads(msgspec.json.encode(value))


def every_key_values() -> dict[str, Any]:
    """Chart values that set every key of every gateway section the schema covers, at the gateway's defaults."""
    model = _plain(ModelConfig(name="m"))
    worker = _plain(WorkerConfig(id="w", url="http://w:8000", model="m"))
    index = {k: v for k, v in _plain(IndexConfig()).items() if k != "block_size"}
    index["groups"] = _plain([GroupSpec(), GroupSpec(kind=GroupKind.SLIDING_WINDOW, sliding_window_tokens=4096)])
    events = _plain(EventsConfig())
    events["subscriber"] = _plain(SubscriberConfig())
    discovered = {k: v for k, v in worker.items() if k not in _OWNED_WORKER_KEYS}
    discovery = _plain(DiscoveryConfig(label_selector="app=vllm"))
    discovery["worker"] = discovered
    extra = _plain(GatewayConfig(models=(ModelConfig(name="m"),)))
    extra.update(models=[model], workers=[worker], events=events, index=index, discovery=discovery,
                 sessions=_plain(SessionsConfig()), policy=_plain(encode_policy_config(SessionStickyConfig())))
    return {"gateway": {"models": [model], "workers": [worker], "policy": extra["policy"], "extraConfig": extra},
            "discovery": {"worker": discovered}}


@pytest.mark.integration
@pytest.mark.parametrize("helm", HELMS)
def test_every_gateway_key_at_its_default_passes_schema_and_gateway(tmp_path, monkeypatch, helm):
    values = every_key_values()
    result = run_helm(_render_args("template", _write(tmp_path, values)), tmp_path, helm)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    raw = gateway_yaml({(d["kind"], d["metadata"]["name"]): d for d in docs})
    for section in ("models", "workers"):  # every key reaches the gateway, nulls (tokenizer_path: null) too
        assert [set(entry) for entry in raw[section]] == [set(entry) for entry in values["gateway"][section]]
    assert raw["models"][0]["tokenizer_path"] is None
    assert set(raw) == set(values["gateway"]["extraConfig"])
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(raw)
    assert decode_discovery_config(config.discovery).worker == values["discovery"]["worker"]
    assert len(index_config(config, config.models[0]).groups) == 2


OLD_STYLE_VALUES = {"gateway": {"extraConfig": {
    "events": {"subscriber": {"replay-timeout-s": 3.0, "max-pending-batches": 8}},
    "index": {"max-blocks": 4096,
              "groups": [{"kind": "full"}, {"kind": "sliding_window", "sliding-window-tokens": 64}]},
}}}


@pytest.mark.integration
@pytest.mark.parametrize("helm", HELMS)
def test_old_kebab_case_keys_still_render_and_load_with_a_warning(tmp_path, monkeypatch, caplog, helm):
    result = run_helm(_render_args("template", _write(tmp_path, OLD_STYLE_VALUES)), tmp_path, helm)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    raw = gateway_yaml({(d["kind"], d["metadata"]["name"]): d for d in docs})
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    with caplog.at_level("WARNING"):
        config = parse_config(raw)
    assert (config.events.subscriber.replay_timeout_s, config.events.subscriber.max_pending_batches) == (3.0, 8)
    assert config.index.max_blocks == 4096 and config.index.groups[1].sliding_window_tokens == 64
    assert sorted(r.getMessage().split()[2] for r in caplog.records if r.name == "router.config") == [
        "events.subscriber.max-pending-batches", "events.subscriber.replay-timeout-s",
        "index.groups[].sliding-window-tokens", "index.max-blocks"]
