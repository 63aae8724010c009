"""The demo's settings and what they set on the fleet: ``DemoConfig``, the policy runs (``POLICIES``), the sim
workers' timing profile and each run's gateway ``policy`` section, and where the bundled trace is.

``loadgen.demo`` (the policy runs), ``loadgen.demo_pd`` (``--pd``) and the benchmarks that build a fleet as the
demo does (``benchmarks.routing``, ``soak``, ``chaos``, ``processes``) read them from here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import yaml

from loadgen.replay import ReplayConfig
from policies.config import CacheAwareConfig
from workers.config import SchedulerConfig, TimingProfile

POLICIES: dict[str, dict[str, Any]] = {
    "round_robin": {"name": "round_robin"},
    "least_loaded": {"name": "least_loaded"},
    "cache_aware": {"name": "cache_aware"},
    "session_sticky+cache_aware": {"name": "session_sticky", "inner": {"name": "cache_aware"}},
}
"""The demo's runs: label -> gateway ``policy`` section."""


DEFAULT_TRACE_CANDIDATES = ("loadgen/data/conversation_trace_head.jsonl",)
"""Where the trace is looked for, relative to the repository root, when ``--trace`` is not given: the bundled slice,
the first 1,000 requests of Mooncake's ``conversation_trace.jsonl`` (``loadgen/data/``)."""


DEFAULT_MAX_REQUESTS = 450
"""Requests in the default slice."""
QUICK_MAX_REQUESTS = 120
"""Requests in the ``--quick`` slice."""


PREFILL_SLOWDOWN = 1.5
"""Default ``prefill_slowdown``: a model about 1.5 times the size of Llama-3-8B on the same GPU."""


class DemoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Settings of one demo run (from the command line)."""

    trace: str
    """The Mooncake ``conversation_trace.jsonl``."""
    out: str = "out/demo"
    """Directory for results, plots and process logs."""
    num_workers: int = 4
    """Sim workers in the fleet."""
    start_s: float = 0.0
    """Trace time where the slice starts, seconds."""
    max_requests: int = DEFAULT_MAX_REQUESTS
    """Requests in the slice."""
    time_scale: float = 5.0
    """Simulated seconds per wall second (workers run ``--time-scale 1/this``)."""
    max_output_tokens: int = 16
    """Cap on each request's output tokens."""
    block_size: int = 16
    """Tokens per KV block of the workers and the gateway."""
    lru_target: float = 0.97
    """Fleet sizing: one LRU with the fleet's capacity must reach this share of the ceiling."""
    headroom: float = 1.25
    """Fleet sizing: capacity multiplier for output tokens and running requests."""
    num_cpu_blocks: int = 0
    """CPU-tier blocks per worker."""
    spread_buckets: bool = False
    """Spread the requests sharing one bucketed timestamp evenly up to the next one (``traces.spread_buckets``)."""
    prefill_slowdown: float = PREFILL_SLOWDOWN
    """The sim workers prefill this many times slower than their default profile (Llama-3-8B on one H200), i.e. a
    larger model; ``cache_aware``'s cost model is given the same rates."""
    gateway_processes: int = 1
    """``kvgate serve --processes``: gateway processes on the one port (``benchmarks.processes --demo``)."""
    redis_url: str | None = None
    """The gateway's session store is Redis at this URL (needed by ``session_sticky`` with several processes)."""
    policies: tuple[str, ...] = tuple(POLICIES)
    """Runs, by label (``POLICIES``)."""
    request_timeout_s: float = 60.0
    """Wall limit per request, seconds."""
    startup_timeout_s: float = 60.0
    """Wall limit for a process to answer its health endpoint, seconds."""
    show_progress: bool = True
    """Live progress bars."""
    write_plots: bool = True
    """Write the PNG plots."""
    is_quick: bool = False
    """The ``--quick`` slice: a note under the checks says that some are expected to fail on it."""
    pd: bool = False
    """Instead of the policy runs: the same requests on an aggregated fleet (``cache_aware``) and on a
    disaggregated fleet of the same size (half prefill, half decode workers, ``models[].pd``), side by side."""
    peers: tuple[str, ...] = ()
    """Peer router runs after kvgate's (``loadgen.peers``), by label (``sglang:cache_aware``...)."""
    long_prefill_token_threshold: int = 0
    """The sim workers' ``scheduler.long-prefill-token-threshold`` (tokens one request computes per step at most,
    vLLM's flag; 0: off, vLLM's default); ``cache_aware``'s cost model is told the same, with the workers' step
    budget."""


def worker_profile(config: DemoConfig) -> dict[str, Any]:
    """The sim workers' ``--profile``: the default timing with prefill ``prefill_slowdown`` times slower, and the
    scheduler's ``long-prefill-token-threshold`` when the config sets one."""
    base = TimingProfile()
    profile: dict[str, Any] = {
        "timing": {
            "prefill-s-per-token": base.prefill_s_per_token * config.prefill_slowdown,
            "attention-s-per-token-pair": base.attention_s_per_token_pair * config.prefill_slowdown,
        }
    }
    if config.long_prefill_token_threshold:
        profile["scheduler"] = {"long-prefill-token-threshold": config.long_prefill_token_threshold}
    return profile


def gateway_policy(label: str, config: DemoConfig) -> dict[str, Any]:
    """The gateway ``policy`` section of a run: ``POLICIES[label]`` with ``cache_aware``'s cost model set to the
    workers' prefill rates and step limits (``max_num_batched_tokens``, ``long_prefill_token_threshold``).
    Calibration is off: the rates are the workers' own profile. (The fleet lists each sim
    worker with its ``time_scale``, ``loadgen.fleet.Fleet.gateway_config``, so the gateway's clock for the worker's
    queue and the TTFT it observes are in the worker's seconds.)"""
    policy = copy.deepcopy(POLICIES[label])
    defaults = CacheAwareConfig()
    knobs = {
        "prefill_linear_tokens_per_s": defaults.prefill_linear_tokens_per_s / config.prefill_slowdown,
        "prefill_quadratic_tokens_sq_per_s": defaults.prefill_quadratic_tokens_sq_per_s / config.prefill_slowdown,
        "enable_calibration": False,
        "max_num_batched_tokens": SchedulerConfig().max_num_batched_tokens,
        "long_prefill_token_threshold": config.long_prefill_token_threshold,
    }
    for section in (policy, policy.get("inner")):
        if section is not None and section.get("name") == "cache_aware":
            section.update(knobs)
    return policy


def write_worker_profile(config: DemoConfig, path: Path) -> Path:
    """Write ``worker_profile(config)`` as YAML to ``path`` (parents created) for the workers' ``--profile``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(worker_profile(config), sort_keys=False))
    return path


def replay_config(config: DemoConfig, gateway_url: str) -> ReplayConfig:
    """The replay of one demo run through the gateway at ``gateway_url``: the config's time scale, output cap and
    request timeout, with the gateway's ``/metrics`` read around the run (mismatches by cause, both PD legs)."""
    return ReplayConfig(
        url=gateway_url,
        time_scale=config.time_scale,
        max_output_tokens=config.max_output_tokens,
        request_timeout_s=config.request_timeout_s,
        metrics_url=gateway_url + "/metrics",
    )


def find_default_trace() -> str | None:
    """The bundled trace slice (``DEFAULT_TRACE_CANDIDATES``), or ``None``."""
    root = Path(__file__).resolve().parent.parent
    for candidate in DEFAULT_TRACE_CANDIDATES:
        path = (root / candidate).resolve()
        if path.is_file():
            return str(path)
    return None
