"""``kvgate demo --pd``: the demo's requests on an aggregated fleet and on a prefill/decode fleet of the same size.

Both fleets have ``num_workers`` sim workers sized as the policy runs' (``loadgen.sizing``) and route with
``cache_aware``; the disaggregated one makes the first half of its workers ``prefill`` and the rest ``decode``, and
serves the model with ``models[].pd`` (vLLM's ``kv_transfer_params`` flow). Each fleet is started fresh (empty
caches) and stopped before the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from loadgen.demo_config import DemoConfig, gateway_policy, replay_config, write_worker_profile
from loadgen.errors import LoadgenError
from loadgen.fleet import Fleet, WorkerSpec
from loadgen.prompts import PromptBuilder
from loadgen.runner import RunOutcome, replay_with_progress
from loadgen.sizing import FleetSizing
from loadgen.traces import TraceRequest


async def run_pd_demo(
    config: DemoConfig, console: Console, requests: Sequence[TraceRequest], sizing: FleetSizing
) -> list[RunOutcome]:
    """Replay ``requests`` on the aggregated fleet (label ``aggregated``), then on the disaggregated one (label
    ``pd <P>P+<D>D``); stops every process it started before returning or raising.

    Raises:
        LoadgenError: fewer than 2 workers, a process that does not start.
    """
    out_dir = Path(config.out)
    num_prefill = max(1, config.num_workers // 2)
    if config.num_workers < 2:
        raise LoadgenError("--pd needs at least 2 workers (a prefill and a decode worker)")
    profile_path = write_worker_profile(config, out_dir / "logs" / "worker-profile.yaml")
    outcomes: list[RunOutcome] = []
    prompts = PromptBuilder()
    for label, roles in (
        ("aggregated", ["both"] * config.num_workers),
        (f"pd {num_prefill}P+{config.num_workers - num_prefill}D",
         ["prefill"] * num_prefill + ["decode"] * (config.num_workers - num_prefill)),
    ):
        fleet = Fleet(out_dir / "logs" / label.split()[0], startup_timeout_s=config.startup_timeout_s)
        try:
            specs = [
                WorkerSpec(f"worker-{i}", sizing.num_gpu_blocks_per_worker, config.num_cpu_blocks, config.block_size,
                           1.0 / config.time_scale, role)
                for i, role in enumerate(roles)
            ]
            fleet.start_workers(specs, ["--profile", str(profile_path)])
            await fleet.wait_ready()
            extra = None
            if label != "aggregated":  # the model served disaggregated over the workers' roles
                extra = {"models": [{"name": "sim", "block_size": config.block_size, "pd": {"protocol": "vllm"}}]}
            fleet.start_gateway(gateway_policy("cache_aware", config), config.block_size, extra)
            await fleet.wait_ready()
            assert fleet.gateway is not None
            outcomes.append(await replay_with_progress(
                requests, replay_config(config, fleet.gateway.url), prompts, label=label,
                workers=[s.worker_id for s in specs], console=console, show_progress=config.show_progress,
            ))
        finally:
            fleet.stop()
    return outcomes
