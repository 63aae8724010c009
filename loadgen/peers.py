"""Peer routers (sglang-router, vllm-router) in front of the sim fleet: where they are installed, how they start.

``scripts/setup-peers`` installs each from PyPI into its own venv under ``peers_dir()``; a peer whose venv is
missing is skipped with that reason. Each runs on 127.0.0.1 only (its HTTP and Prometheus listeners), with
``HF_HUB_OFFLINE=1`` so that it never reaches for a tokenizer online (``../shared/reference/peers.md``).

Session keys: ``sglang:manual`` routes by ``x-smg-routing-key``, ``vllm:consistent_hash`` by ``x-session-id``;
the peers' ``cache_aware`` gets no session header. The sim worker names itself in ``x-worker-id``, which every
router relays, so a peer's load per worker is counted too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgspec

from loadgen.errors import LoadgenError
from loadgen.fleet import HOST

__all__ = ["PEERS", "PeerRouter", "installed_peers", "peer_argv", "peers_dir", "resolve_peer"]

PEERS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "sglang": ("sglang-router", "sglang_router.launch_router", ("cache_aware", "manual"), "warn"),
    "vllm": ("vllm-router", "vllm_router.launch_router", ("cache_aware", "consistent_hash"), "warning"),
}
"""Peer -> (PyPI package and venv name, launch module, policies run, its ``--log-level`` for warnings)."""
SESSION_HEADER: dict[str, str] = {"sglang:manual": "x-smg-routing-key", "vllm:consistent_hash": "x-session-id"}
"""The header each session-keyed peer policy routes by."""
NO_SESSION_HEADER = "x-bench-session"
"""Where the replay puts the session id for routers that must not see one (no router reads it)."""
SIM_WORKER_HEADER = "x-worker-id"
"""The sim worker's own name in its responses (``workers.server.WORKER_ID_HEADER``)."""
PEER_ENV = {"HF_HUB_OFFLINE": "1"}
"""Environment added for every peer process."""


class PeerRouter(msgspec.Struct, frozen=True):
    """One peer router run: ``label`` (``<peer>:<policy>``), the python that runs it, or why it is skipped."""

    label: str
    python: str | None = None
    skip_reason: str | None = None

    @property
    def session_header(self) -> str:
        """The request header the replay puts the session id in for this run."""
        return SESSION_HEADER.get(self.label, NO_SESSION_HEADER)


def peers_dir() -> Path:
    """Where ``scripts/setup-peers`` puts the venvs (``KVGATE_PEERS_DIR``, default ``~/.cache/kvgate/peers``)."""
    return Path(os.environ.get("KVGATE_PEERS_DIR", Path.home() / ".cache" / "kvgate" / "peers"))


def peer_labels() -> list[str]:
    """Every peer run, ``<peer>:<policy>``."""
    return [f"{peer}:{p}" for peer, (_, _, policies, _) in PEERS.items() for p in policies]


def resolve_peer(label: str) -> PeerRouter:
    """The run of ``label``; skipped with the reason when its venv is missing.

    Raises:
        LoadgenError: an unknown peer or policy.
    """
    kind, _, policy = label.partition(":")
    if kind not in PEERS or policy not in PEERS[kind][2]:
        raise LoadgenError(f"unknown peer router {label!r}; known: {', '.join(peer_labels())}")
    python = peers_dir() / PEERS[kind][0] / "bin" / "python"
    if not python.is_file():
        return PeerRouter(label, None, f"{PEERS[kind][0]} is not installed (run scripts/setup-peers)")
    return PeerRouter(label, str(python))


def installed_peers() -> list[PeerRouter]:
    """Every peer run whose venv is present."""
    return [p for p in map(resolve_peer, peer_labels()) if p.skip_reason is None]


def peer_argv(peer: PeerRouter, worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
    """The command line of a peer router on 127.0.0.1 (every listener on loopback)."""
    kind, _, policy = peer.label.partition(":")
    if peer.python is None:
        raise LoadgenError(f"{peer.label} is not installed: {peer.skip_reason}")
    return [peer.python, "-m", PEERS[kind][1], "--host", HOST, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
            "--log-level", PEERS[kind][3]]
