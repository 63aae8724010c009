"""``kvgate demo --scenario agentic``: coding-agent sessions, closed loop, on GPU-only, split-pool and shared-pool
fleets.

Steps:

1. Read the kv-cache-tester sessions (``loadgen/data/kv-cache-tester/``, a subset of callanjfox/kv-cache-tester,
   Apache-2.0; ``--trace DIR`` for the full set), each file its own namespace, at most ``max_turns_per_session``
   turns each, think times capped at ``max_think_s``. A level of ``L`` sessions in flight replays
   ``L × sessions_per_slot`` sessions: the originals, then copies under fresh namespaces and session ids (copy
   ``k`` of every session; prompts of different copies share nothing), so 64 sessions in flight are 64 distinct
   conversations of the bundled shapes, and a slot whose session ends takes the next from the queue.
2. Size the fleet from the sessions: the working set of the top concurrency level is ``top level × mean session
   context`` blocks; each worker gets ``gpu_share`` of it ÷ workers GPU blocks (at least 1.05 × the longest
   prompt) and, in the split and shared configurations, CPU blocks up to ``2 × gpu_share`` of it ÷ workers (at
   least a quarter of its GPU blocks), so GPU plus CPU hold about ``2 × gpu_share`` (< 1) of the top level's
   working set: it overflows both tiers (the printed sizing says by how much). The shared pool holds
   ``pool_share`` × that working set: each worker gives Mooncake a segment of at least 16 MiB and the block
   values are padded (``--pool-value-bytes-per-block``) so that the segments hold that many blocks; every level
   writes new namespaces into it, so the master evicts.
3. For each configuration (``gpu``, ``split``, ``shared``, ``pd-split``, ``pd-shared``) start the sim workers
   (``pd-*``: the first half prefill, the rest decode, the model served with ``pd.protocol: vllm``; for the
   shared ones a ``mooncake_master`` on 127.0.0.1 that every worker's pool tier is a client of), then for each
   level: reset the workers' caches, start the gateway (``cache_aware``, tier-aware pricing, the same for every
   configuration; the pool workers are declared members of ``MOONCAKE``), replay every session closed loop with
   that many in flight and their think times (``time_scale`` times faster), and read the workers' per-tier
   counters (``kvgate_worker_cached_prompt_tokens_by_medium``, ``kvgate_worker_pool_read_wall_seconds``) before
   and after. Throughput is measured while every slot is busy (``loadgen.agentic_steady``: from the start
   until the last session left the queue); the whole run's figure, whose tail is the longest sessions' think
   times alone, is printed beside it.
4. Print the table, the targets, the seeds' figures beside ours; write ``agentic.json``, ``agentic.md`` and
   ``agentic.png`` to ``--out``.

Restore times are the sim timing model's (``workers.config.TimingProfile``): ``latency + bytes ÷ bandwidth`` per
tier for the mean restore size of the level. Beside them, the wall time of the real Mooncake reads (the sim
worker reads every restored block's bytes from the pool, on the pool's I/O thread while its engine keeps running
the other sequences): a restoring request waits for the later of the model's restore and its read, so on a
loaded host, where a read takes longer than the model's restore, the report, whose times are wall ×
``time_scale``, counts that wait that many times over (``agentic_report.explain`` says how much from the run's
own numbers).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from loadgen.agentic_steady import SteadyState, steady_state
from loadgen.errors import LoadgenError
from loadgen.fleet import HOST, Fleet, WorkerSpec
from loadgen.ports import PortPicker
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig
from loadgen.runner import replay_with_progress
from loadgen.traces import TraceRequest, read_agentic_sessions
from policies.config import CacheAwareConfig
from workers.config import TimingProfile

CONFIGS = ("gpu", "split", "shared", "pd-split", "pd-shared")
"""Fleet configurations: GPU only; GPU + per-worker CPU tier (split pools); GPU + CPU + one shared pool; and the
same split-versus-shared pair on a prefill/decode fleet (the first half of the workers prefill, the rest decode),
where a conversation's KV on a decode worker's CPU tier is unreachable from the prefill side unless it is in the
shared pool."""

PD_PROTOCOL = "vllm"
"""The PD configurations' wire protocol (``models[].pd.protocol``; vLLM's ``kv_transfer_params`` flow)."""

BUNDLED_DIR = Path(__file__).resolve().parent / "data" / "kv-cache-tester"


SIM_VALUE_BYTES_PER_TOKEN = 4
"""The sim pool tier stores a block's token ids (u32): its value size per token (``workers.kv.pool_tier``)."""
POOL_LEASE_MS = 1000
"""The demo master's lease (wall ms): what a lookup or a use keeps from eviction. Mooncake's default is 5 s of
real time; at the demo's time scale a 10 s lease would shield 200 simulated seconds of writes, a full pool's worth,
from eviction, and every put past the high watermark would be refused."""
MIN_SEGMENT_BYTES = 16 << 20
"""The smallest segment a Mooncake client may contribute (its ``client_buffer_allocation`` refuses less)."""

SEEDS = (
    ("shared ÷ per-server pool throughput at 96 and 112 sessions", "~2×"),
    ("prompt reuse, shared pool (ceiling the traces allow)", "94–96% (96–97%)"),
    ("pool's share of prompt tokens at 112 sessions (one server)", "46%"),
    ("typical restore size", "110K–130K tokens"),
    ("median TTFT at 112 sessions", "~7 s (decode memory full)"),
)
"""The figures the engine we learn from reported (four 8-GPU servers, 1.5 TiB pool ≈ 4× prefill KV space)."""

SEEDS_NOTE = (
    "The sim reproduces the mechanism (GPU and CPU overflow, sessions moving between workers, what a shared pool "
    "keeps reachable, a PD fleet whose decode side's host memory the prefill side cannot read) and the reuse and "
    "tier shares it implies; absolute throughput and TTFT come from the sim timing model (one H200-class profile, "
    "prefill 1.5× Llama-3-8B), not from the seeds' hardware; the sim models no decode-memory pressure (a decode "
    "step's time does not grow as decode memory fills), so the ~7 s median TTFT is not reproduced."
)

class AgenticConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Settings of one agentic run (from the command line)."""

    trace_dir: str
    out: str = "out/agentic"
    num_workers: int = 4
    levels: tuple[int, ...] = (16, 32, 48, 64)
    configs: tuple[str, ...] = CONFIGS
    max_turns_per_session: int = 10
    sessions_per_slot: int = 2
    """Sessions each of a level's slots replays in turn (a level of ``L`` replays ``L × sessions_per_slot``): a
    slot whose session ends takes the next one, as kv-cache-tester's ``--recycle`` does, so every slot stays busy
    over the steady window that throughput is measured on (``loadgen.agentic_steady``)."""
    max_think_s: float = 60.0
    """Think times are capped at this many simulated seconds (the traces' tail reaches an hour of idle user)."""
    time_scale: float = 20.0
    max_output_tokens: int = 32
    block_size: int = 64
    gpu_share: float = 0.3
    pool_share: float = 1.5
    prefill_slowdown: float = 1.5
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 60.0
    show_progress: bool = True
    write_plots: bool = True


class Sizing(msgspec.Struct, frozen=True):
    """The fleet's KV capacity (blocks of ``block_size`` tokens; the pool in bytes too)."""

    num_sessions: int
    num_requests: int
    mean_session_blocks: float
    top_working_set_blocks: int
    num_gpu_blocks_per_worker: int
    num_cpu_blocks_per_worker: int
    pool_capacity_blocks: int
    pool_segment_bytes_per_worker: int
    pool_value_bytes_per_block: int
    mean_prompt_tokens: float = 0.0
    mean_think_s: float = 0.0
    """Mean think time before a turn (simulated seconds, after the cap; the first turn's 0 included)."""


class LevelResult(msgspec.Struct):
    """One configuration at one concurrency level."""

    config: str
    level: int
    requests_ok: int
    requests_failed: int
    reuse: float
    ceiling: float
    reuse_of_ceiling: float | None
    share_gpu: float
    share_cpu: float
    share_pool: float
    share_computed: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    num_restores: int
    mean_restore_tokens: float
    mean_restore_s: float
    cached_mismatch_ratio: float | None
    pool_evicted_keys: int | None = None
    cached_mismatch_index_ratio: float | None = None
    """Share of requests whose mismatch the gateway put down to a wrong index (``cached_mismatch_index_ratio``
    of ``loadgen.report``; the rest are forecast misses: blocks evicted or still pending after the decision, or
    store events in flight); ``None`` when the gateway's counts could not be read."""
    mean_pool_read_wall_s: float | None = None
    """Real (wall) seconds a shared-pool restore read took on this host, mean over the level's reads (``None``
    without a pool): the restoring request waits for it (the worker's other sequences keep running: the read is
    on the pool's I/O thread), and the report counts it ``time_scale`` times (times are wall × time scale),
    unlike the model's ``mean_restore_s``."""
    num_pool_short_reads: int = 0
    """Pool reads that found fewer blocks than the lookup counted (the master evicted them in between): the
    request computed the rest, and the gateway, which hears of no Mooncake eviction, counts the cached-token
    mismatch as a wrong index."""
    errors_by_kind: dict[str, int] = msgspec.field(default_factory=dict)
    """The level's failed requests by kind (``loadgen.client``: ``timeout``, ``http_<status>``, ``stream``,
    ``connect``...), so a reader sees which level failed and how."""
    error_examples: dict[str, str] = msgspec.field(default_factory=dict)
    """The first failed request of each kind: request id and message (``loadgen.report.RunSummary``)."""
    steady: SteadyState | None = None
    """Throughput while every slot was busy, and the turn's time split into think, TTFT and the rest
    (``loadgen.agentic_steady``); ``None`` when not measured."""

    @property
    def throughput_prompt_tokens_per_s(self) -> float:
        """Prompt tokens per simulated second over the steady window, or over the whole run without one."""
        if self.steady is not None and self.steady.window_s > 0:
            return self.steady.prompt_tokens_per_s
        return self.prompt_tokens_per_s

    @property
    def throughput_output_tokens_per_s(self) -> float:
        """Output tokens per simulated second over the steady window, or over the whole run without one."""
        if self.steady is not None and self.steady.window_s > 0:
            return self.steady.output_tokens_per_s
        return self.output_tokens_per_s


def read_sessions(config: AgenticConfig) -> list[TraceRequest]:
    """The sessions of ``config.trace_dir`` (module docstring, step 1), think times capped at ``max_think_s``."""
    requests = read_agentic_sessions([config.trace_dir], max_requests_per_session=config.max_turns_per_session)
    cap = config.max_think_s
    return [r if r.think_time_s <= cap else msgspec.structs.replace(r, think_time_s=cap) for r in requests]


def size_fleet(requests: Sequence[TraceRequest], config: AgenticConfig) -> Sizing:
    """Module docstring, step 2."""
    longest: dict[str, int] = {}
    for r in requests:
        longest[r.session_id] = max(longest.get(r.session_id, 0), math.ceil(r.num_prompt_tokens / config.block_size))
    mean = sum(longest.values()) / max(1, len(longest))
    top = max(config.levels)  # copies of the sessions fill the levels above their number (step 1)
    working = math.ceil(top * mean)
    max_prompt = max(longest.values(), default=1)
    gpu = max(math.ceil(config.gpu_share * working / config.num_workers), math.ceil(1.05 * max_prompt))
    own = math.ceil(2 * config.gpu_share * working / config.num_workers)  # GPU + CPU per worker
    cpu = max(math.ceil(0.25 * gpu), own - gpu)
    pool_blocks = math.ceil(config.pool_share * working)
    token_bytes = config.block_size * SIM_VALUE_BYTES_PER_TOKEN
    segment = max(MIN_SEGMENT_BYTES, math.ceil(pool_blocks * token_bytes / config.num_workers))
    value_bytes = max(token_bytes, segment * config.num_workers // pool_blocks)
    return Sizing(
        num_sessions=len(longest),
        num_requests=len(requests),
        mean_session_blocks=mean,
        top_working_set_blocks=working,
        num_gpu_blocks_per_worker=gpu,
        num_cpu_blocks_per_worker=cpu,
        pool_capacity_blocks=pool_blocks,
        pool_segment_bytes_per_worker=segment,
        pool_value_bytes_per_block=value_bytes,
        mean_prompt_tokens=sum(r.num_prompt_tokens for r in requests) / max(1, len(requests)),
        mean_think_s=sum(r.think_time_s for r in requests) / max(1, len(requests)),
    )


def with_copies(requests: Sequence[TraceRequest], num_sessions: int) -> list[TraceRequest]:
    """At least ``num_sessions`` sessions: the originals, then whole copies of every session under fresh
    namespaces and session ids (``c<k>/``), as many as needed (module docstring, step 1)."""
    sessions = {r.session_id for r in requests}
    num_copies = max(1, math.ceil(num_sessions / max(1, len(sessions))))
    out = list(requests)
    for k in range(1, num_copies):
        out += [
            msgspec.structs.replace(r, namespace=f"c{k}/{r.namespace}", session_id=f"c{k}/{r.session_id}")
            for r in requests
        ]
    return out


def in_namespace(requests: Sequence[TraceRequest], tag: str) -> list[TraceRequest]:
    """The same sessions under fresh namespaces (new prompt text), so a level starts cold in the shared pool."""
    return [msgspec.structs.replace(r, namespace=f"{tag}/{r.namespace}") for r in requests]


class MooncakeMaster:
    """A ``mooncake_master`` on 127.0.0.1 in its own process group (stopped by ``stop``)."""

    def __init__(self, log_path: Path, lease_ms: int = 10_000) -> None:
        binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        if not Path(binary).exists():
            raise LoadgenError("the shared configuration needs mooncake_master (pip install kvgate[mooncake])")
        self.rpc_port, self.metrics_port = PortPicker().ports(2)
        self.lease_ms = lease_ms
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(  # noqa: S603 - a fixed binary, no shell
                [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={lease_ms}",
                 "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.1"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection((HOST, self.rpc_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise LoadgenError(f"mooncake_master did not start; see {log_path}")

    @property
    def address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    async def metric(self, name: str) -> float | None:
        """One value of the master's Prometheus metrics (``None`` when unreadable)."""
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://{HOST}:{self.metrics_port}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        for line in text.splitlines():  # plain lines: a parser renames the master's un-suffixed counters
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


async def tier_counters(urls: Sequence[str]) -> dict[str, float]:
    """Sum over workers of their cached tokens per medium, prompt tokens and restores (``/metrics``)."""
    out: dict[str, float] = {"GPU": 0.0, "CPU": 0.0, "MOONCAKE": 0.0, "restores": 0.0, "pool_reads": 0.0,
                             "pool_read_wall_s": 0.0, "pool_short_reads": 0.0}
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "kvgate_worker_cached_prompt_tokens_by_medium_total":
                        out[sample.labels["medium"]] += sample.value
                    elif sample.name == "kvgate_worker_restores_total":
                        out["restores"] += sample.value
                    elif sample.name == "kvgate_worker_pool_reads":
                        out["pool_reads"] += sample.value
                    elif sample.name == "kvgate_worker_pool_read_wall_seconds":
                        out["pool_read_wall_s"] += sample.value
                    elif sample.name == "kvgate_worker_pool_short_reads":
                        out["pool_short_reads"] += sample.value
    return out


def restore_time_s(cpu_tokens: float, pool_tokens: float, profile: TimingProfile) -> float:
    """The sim timing model's time of one restore of ``cpu_tokens`` from CPU and ``pool_tokens`` from the pool."""
    t = 0.0
    if cpu_tokens:
        t += profile.copy_latency_s + cpu_tokens * profile.kv_bytes_per_token / profile.host_to_gpu_bytes_per_s
    if pool_tokens:
        t += profile.pool_latency_s + pool_tokens * profile.kv_bytes_per_token / profile.pool_bytes_per_s
    return t


def sim_profile(prefill_slowdown: float) -> dict[str, Any]:
    """The sim workers' ``--profile``: the default timing with prefill ``prefill_slowdown`` times slower (as the
    conversation demo's)."""
    base = TimingProfile()
    return {
        "timing": {
            "prefill-s-per-token": base.prefill_s_per_token * prefill_slowdown,
            "attention-s-per-token-pair": base.attention_s_per_token_pair * prefill_slowdown,
        }
    }


def cache_aware_policy(prefill_slowdown: float) -> dict[str, Any]:
    """``cache_aware`` with the workers' prefill rates and no online calibration (as the conversation demo's)."""
    defaults = CacheAwareConfig()
    return {
        "name": "cache_aware",
        "prefill_linear_tokens_per_s": defaults.prefill_linear_tokens_per_s / prefill_slowdown,
        "prefill_quadratic_tokens_sq_per_s": defaults.prefill_quadratic_tokens_sq_per_s / prefill_slowdown,
        "enable_calibration": False,
    }


async def run_agentic(config: AgenticConfig, console: Console) -> tuple[list[LevelResult], Sizing]:
    """Module docstring, step 3; stops every process it started."""
    requests = read_sessions(config)
    if not requests:
        raise LoadgenError(f"no sessions in {config.trace_dir}")
    sizing = size_fleet(requests, config)
    own_blocks = (sizing.num_gpu_blocks_per_worker + sizing.num_cpu_blocks_per_worker) * config.num_workers
    own_share = own_blocks / max(1, sizing.top_working_set_blocks)
    console.print(
        f"sessions: {sizing.num_sessions}, {sizing.num_requests} requests (a level of N sessions in flight replays "
        f"them as N × {config.sessions_per_slot} sessions, --sessions-per-slot), mean context "
        f"{sizing.mean_session_blocks * config.block_size:.0f} tokens; top-level working set "
        f"{sizing.top_working_set_blocks} blocks; per worker {sizing.num_gpu_blocks_per_worker} GPU "
        f"(+ {sizing.num_cpu_blocks_per_worker} CPU) blocks, GPU + CPU = "
        f"{own_share:.2f} "
        f"of the top level's working set; shared pool {sizing.pool_capacity_blocks} blocks"
    )
    policy = cache_aware_policy(config.prefill_slowdown)
    profile = TimingProfile()
    out_dir = Path(config.out)
    prompts = PromptBuilder()
    results: list[LevelResult] = []
    levels = sorted(set(config.levels))
    for name in config.configs:
        fleet = Fleet(out_dir / "logs" / name, startup_timeout_s=config.startup_timeout_s)
        master: MooncakeMaster | None = None
        try:
            extra: list[str] = []
            pooled = name in ("shared", "pd-shared")
            if pooled:
                master = MooncakeMaster(out_dir / "logs" / name / "mooncake_master.log", lease_ms=POOL_LEASE_MS)
                extra = ["--pool-backend", "mooncake", "--mooncake-master", master.address,
                         "--mooncake-global-segment-size", str(sizing.pool_segment_bytes_per_worker),
                         "--pool-value-bytes-per-block", str(sizing.pool_value_bytes_per_block)]  # fmt: skip
            num_cpu = 0 if name == "gpu" else sizing.num_cpu_blocks_per_worker
            specs = [
                WorkerSpec(f"worker-{i}", sizing.num_gpu_blocks_per_worker, num_cpu, config.block_size,
                           1.0 / config.time_scale, role)
                for i, role in enumerate(worker_roles(name, config.num_workers))
            ]  # fmt: skip
            profile_path = out_dir / "logs" / name / "worker-profile.yaml"
            profile_path.parent.mkdir(parents=True, exist_ok=True)
            profile_path.write_text(yaml.safe_dump(sim_profile(config.prefill_slowdown), sort_keys=False))
            fleet.start_workers(specs, ["--profile", str(profile_path), *extra])
            await fleet.wait_ready()
            if pooled:
                fleet.worker_extra = {"pools": ["MOONCAKE"]}
            gateway_extra: dict[str, Any] = {}
            if name.startswith("pd-"):  # the model served disaggregated over the workers' roles
                pd_model = {"name": "sim", "block_size": config.block_size, "pd": pd_section(config)}
                gateway_extra["models"] = [pd_model]
            if master is not None:
                gateway_extra["pool_watch"] = pool_watch_section(master)
            for level in levels:
                await fleet.reset_caches()
                fleet.start_gateway(policy, config.block_size, gateway_extra or None)
                await fleet.wait_ready()
                assert fleet.gateway is not None
                urls = [w.url for w in fleet.workers]
                before = await tier_counters(urls)
                evicted_before = await master.metric("master_evicted_key_count") if master else None
                replay = ReplayConfig(
                    url=fleet.gateway.url, mode="closed", concurrency=level, time_scale=config.time_scale,
                    max_output_tokens=config.max_output_tokens, request_timeout_s=config.request_timeout_s,
                    metrics_url=fleet.gateway.url + "/metrics",  # mismatches by cause
                )  # fmt: skip
                replayed = in_namespace(with_copies(requests, level * config.sessions_per_slot), f"{name}-{level}")
                outcome = await replay_with_progress(
                    replayed, replay, prompts,
                    label=f"{name} @ {level}",
                    workers=[s.worker_id for s in specs], console=console, show_progress=config.show_progress,
                )  # fmt: skip
                fleet.stop_gateway()
                after = await tier_counters(urls)
                evicted_after = await master.metric("master_evicted_key_count") if master else None
                row = level_result(name, level, outcome.summary, before, after, profile, evicted_before, evicted_after)
                steady = steady_state(outcome.records, replayed, config.time_scale, level)
                results.append(msgspec.structs.replace(row, steady=steady))
        finally:
            fleet.stop()
            if master is not None:
                master.stop()
    return results, sizing


def pool_watch_section(master: MooncakeMaster) -> dict[str, Any]:
    """The gateway's ``pool_watch``: what the master evicted leaves the index within a sweep (each second), and a
    decision whose pool blocks no sweep confirmed lately asks the master first (2 ms at most), as an operator of a
    shared pool runs it (``router.pool_watch``); times are wall seconds, the lease the master's."""
    lease_s = master.lease_ms / 1000
    return {
        "admin_url": f"http://{HOST}:{master.metrics_port}",
        "lease_ttl_s": lease_s,
        "interval_s": lease_s / 2,
        "entry_ttl_s": lease_s,
        "decision_check_budget_s": 0.002,
    }


def pd_section(config: AgenticConfig) -> dict[str, Any]:
    """The PD configurations' ``models[].pd``: a request waits for decode room as long as the client waits for
    its answer (``request_timeout_s``, wall seconds) and every session in flight may wait at once, so a decode
    side that is full shows as time to first token, as the seeds' agents saw it, not as refusals (the gateway's
    default 5 s wait answered hundreds of 429s at 64 sessions: 5 wall s are only ``5 × time_scale`` simulated s,
    less than a queue of 100K-token prefills holding the decode reservations takes)."""
    return {
        "protocol": PD_PROTOCOL,
        "queue_timeout_s": config.request_timeout_s,
        "max_waiting": max(config.levels, default=1),
    }


def worker_roles(config_name: str, num_workers: int) -> list[str]:
    """The workers' roles in a configuration: ``both`` everywhere, or for ``pd-*`` the first half (at least one)
    ``prefill`` and the rest ``decode``.

    Raises:
        LoadgenError: a ``pd-*`` configuration with fewer than 2 workers.
    """
    if not config_name.startswith("pd-"):
        return ["both"] * num_workers
    if num_workers < 2:
        raise LoadgenError("the pd-* configurations need at least 2 workers (a prefill and a decode worker)")
    num_prefill = max(1, num_workers // 2)
    return ["prefill"] * num_prefill + ["decode"] * (num_workers - num_prefill)


def level_result(
    name: str,
    level: int,
    summary: Any,
    before: dict[str, float],
    after: dict[str, float],
    profile: TimingProfile,
    evicted_before: float | None,
    evicted_after: float | None,
) -> LevelResult:
    """One row from a run's summary and the workers' counter deltas."""
    delta = {k: after[k] - before[k] for k in after}
    prompt = summary.num_prompt_tokens or 1
    restores = int(delta["restores"])
    cpu_per = delta["CPU"] / restores if restores else 0.0
    pool_per = delta["MOONCAKE"] / restores if restores else 0.0
    duration = summary.duration_s or 1.0
    return LevelResult(
        config=name,
        level=level,
        requests_ok=summary.requests_ok,
        requests_failed=summary.requests_failed,
        reuse=summary.hit_ratio,
        ceiling=summary.ceiling_hit_ratio,
        reuse_of_ceiling=summary.fraction_of_ceiling,
        share_gpu=delta["GPU"] / prompt,
        share_cpu=delta["CPU"] / prompt,
        share_pool=delta["MOONCAKE"] / prompt,
        share_computed=max(0.0, 1.0 - (delta["GPU"] + delta["CPU"] + delta["MOONCAKE"]) / prompt),
        prompt_tokens_per_s=summary.num_prompt_tokens / duration,
        output_tokens_per_s=summary.output_tokens_per_s,
        ttft_p50_s=summary.ttft_p50_s,
        ttft_p99_s=summary.ttft_p99_s,
        num_restores=restores,
        mean_restore_tokens=cpu_per + pool_per,
        mean_restore_s=restore_time_s(cpu_per, pool_per, profile),
        cached_mismatch_ratio=summary.cached_tokens_mismatch_ratio,
        cached_mismatch_index_ratio=summary.cached_mismatch_index_ratio,
        pool_evicted_keys=None
        if evicted_before is None or evicted_after is None
        else int(evicted_after - evicted_before),
        mean_pool_read_wall_s=delta["pool_read_wall_s"] / delta["pool_reads"] if delta["pool_reads"] else None,
        num_pool_short_reads=int(delta.get("pool_short_reads", 0.0)),
        errors_by_kind=dict(sorted(summary.errors_by_kind.items())),
        error_examples=dict(sorted(summary.error_examples.items())),
    )
