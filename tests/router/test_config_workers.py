"""``workers[]`` entries: dp_ranks bounded with every rank's port in range, base URLs only (a trailing ``/``
dropped), and a block size that is a multiple of the model's. Each refusal names the key."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import MAX_DP_RANKS, decode_worker, parse_config
from router.errors import ConfigError

pytestmark = pytest.mark.unit


def config_with_worker(models: list[dict[str, Any]] | None = None, **worker: Any) -> dict[str, Any]:
    return {
        "models": models or [{"name": "m", "block_size": 16}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:8001", "model": "m", **worker}],
        "admin": {"token": "t"},
    }


def refusal(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return info.value.message


# -- dp_ranks and per-rank ports -----------------------------------------------------------------------------------


def test_max_dp_ranks_is_256() -> None:
    assert MAX_DP_RANKS == 256


@pytest.mark.parametrize("dp_ranks", [0, -1, 257, 3000])
def test_dp_ranks_out_of_range_is_refused(dp_ranks: int) -> None:
    assert refusal(config_with_worker(dp_ranks=dp_ranks)) == (
        f"config: dp_ranks must be in 1..256, got {dp_ranks} - at `$.workers[0]`")
    with pytest.raises(ConfigError) as info:
        decode_worker({"id": "w0", "url": "http://127.0.0.1:8001", "model": "m", "dp_ranks": dp_ranks})
    assert info.value.message == f"worker: dp_ranks must be in 1..256, got {dp_ranks}"


def test_dp_ranks_up_to_the_maximum_with_ports_in_range_load() -> None:
    config = parse_config(config_with_worker(dp_ranks=256, events_endpoint="tcp://127.0.0.1:65280",
                                             replay_endpoint="tcp://127.0.0.1:65024"))
    assert config.workers[0].dp_ranks == 256  # ranks publish on 65280..65535 and replay on 65024..65279


@pytest.mark.parametrize("key", ["events_endpoint", "replay_endpoint"])
def test_a_rank_port_over_65535_is_refused(key: str) -> None:
    assert refusal(config_with_worker(dp_ranks=256, **{key: "tcp://127.0.0.1:65281"})) == (
        f"config: {key} 'tcp://127.0.0.1:65281' with dp_ranks 256: rank r uses port 65281 + r, so rank 255 would "
        "use port 65536, over 65535 - at `$.workers[0]`")
    assert refusal(config_with_worker(**{key: "tcp://127.0.0.1:70000"})) == (
        f"config: {key} 'tcp://127.0.0.1:70000' with dp_ranks 1: rank r uses port 70000 + r, so rank 0 would use "
        "port 70000, over 65535 - at `$.workers[0]`")


def test_endpoints_without_a_numeric_port_are_not_offset_and_not_refused() -> None:
    config = parse_config(config_with_worker(dp_ranks=8, events_endpoint="ipc:///tmp/kv-65535",
                                             replay_endpoint="tcp://127.0.0.1:*"))
    assert config.workers[0].events_endpoint == "ipc:///tmp/kv-65535"


def test_bind_topology_ignores_the_events_endpoint_port() -> None:
    raw = config_with_worker(dp_ranks=4, topology="bind", events_endpoint="tcp://127.0.0.1:65535")
    raw["events"] = {"bind_endpoint": "tcp://127.0.0.1:5557"}
    assert parse_config(raw).workers[0].dp_ranks == 4


# -- url -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "normalized"), [
    ("http://127.0.0.1:8001/", "http://127.0.0.1:8001"),
    ("http://127.0.0.1:8001", "http://127.0.0.1:8001"),
    ("https://worker.example/", "https://worker.example"),
    ("http://[::1]:8001/", "http://[::1]:8001"),
])
def test_url_trailing_slash_is_dropped(url: str, normalized: str) -> None:
    assert parse_config(config_with_worker(url=url)).workers[0].url == normalized
    assert decode_worker({"id": "w0", "url": url, "model": "m"}).url == normalized


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8001/v1",
    "http://127.0.0.1:8001//",
    "http://127.0.0.1:8001/v1/",
    "http://127.0.0.1:8001?x=1",
    "http://127.0.0.1:8001/?",
    "http://127.0.0.1:8001#frag",
])
def test_url_with_a_path_query_or_fragment_is_refused(url: str) -> None:
    reason = ("url must be a base URL, http(s)://host[:port], without a path, query or fragment (request paths such "
              f"as /v1/completions are appended to it), got {url!r}")
    assert refusal(config_with_worker(url=url)) == f"config: {reason} - at `$.workers[0]`"
    with pytest.raises(ConfigError) as info:
        decode_worker({"id": "w0", "url": url, "model": "m"})
    assert info.value.message == f"worker: {reason}"


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8001", "127.0.0.1:8001", "HTTP://127.0.0.1:8001"])
def test_url_with_another_scheme_is_refused(url: str) -> None:
    assert refusal(config_with_worker(url=url)) == (
        f"config: url must start with http:// or https://, got {url!r} - at `$.workers[0]`")


# -- block size ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model_block_size", "worker_block_size"), [(32, 16), (32, 48), (16, 8), (16, 17)])
def test_worker_block_size_not_a_multiple_of_the_models_is_refused(model_block_size: int,
                                                                     worker_block_size: int) -> None:
    raw = config_with_worker([{"name": "m", "block_size": model_block_size}], block_size=worker_block_size)
    assert refusal(raw) == (
        f"config: workers[0].block_size {worker_block_size} is not a multiple of the block_size {model_block_size} "
        "of its model 'm' (models[].block_size): its events could not be indexed")


def test_block_size_check_applies_to_a_lora_adapter_model_and_to_the_right_worker() -> None:
    raw = config_with_worker([{"name": "m", "block_size": 32, "lora_adapters": ["m-lora"]}], block_size=64)
    raw["workers"].append({"id": "w1", "url": "http://127.0.0.1:8002", "model": "m-lora", "block_size": 16})
    assert refusal(raw) == (
        "config: workers[1].block_size 16 is not a multiple of the block_size 32 of its model 'm' "
        "(models[].block_size): its events could not be indexed")


@pytest.mark.parametrize("worker_block_size", [None, 32, 64, 96])
def test_worker_block_size_multiple_of_the_models_loads(worker_block_size: int | None) -> None:
    raw = config_with_worker([{"name": "m", "block_size": 32}], block_size=worker_block_size)
    assert parse_config(raw).workers[0].block_size == worker_block_size
