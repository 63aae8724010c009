"""Peer routers: where they are looked for, the exact command lines, the side-by-side table's spread."""

from __future__ import annotations

import pytest

from loadgen.errors import LoadgenError
from loadgen.peers import PeerRouter, installed_peers, peer_argv, resolve_peer

pytestmark = pytest.mark.unit


def test_a_missing_venv_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path))
    peer = resolve_peer("sglang:cache_aware")
    assert peer == PeerRouter("sglang:cache_aware", None,
                              "sglang-router is not installed (run scripts/setup-peers)")
    assert installed_peers() == []
    (tmp_path / "vllm-router" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-router" / "bin" / "python").write_text("")
    assert [p.label for p in installed_peers()] == ["vllm:cache_aware", "vllm:consistent_hash"]
    with pytest.raises(LoadgenError, match="unknown peer router 'vllm:manual'"):
        resolve_peer("vllm:manual")


def test_command_lines_listen_on_loopback_only():
    sglang = PeerRouter("sglang:manual", "/p/python")
    assert peer_argv(sglang, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 30000, 29000) == [
        "/p/python", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "30000",
        "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy", "manual",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "29000", "--log-level", "warn"]
    assert sglang.session_header == "x-smg-routing-key"
    vllm = PeerRouter("vllm:consistent_hash", "/v/python")
    assert peer_argv(vllm, ["http://127.0.0.1:1"], 1, 2)[-2:] == ["--log-level", "warning"]
    assert vllm.session_header == "x-session-id"
    assert PeerRouter("vllm:cache_aware", "/v/python").session_header == "x-bench-session"


def test_the_table_shows_the_mean_and_the_spread():
    from benchmarks.routing import _spread

    assert _spread([0.9, 1.0, None], ".2f") == "0.95 (0.90–1.00)"
    assert _spread([0.5, 0.5], ".2f") == "0.50"
    assert _spread([None], ".2f") == "–"
