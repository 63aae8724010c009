"""Local processes for the demo: sim workers and the gateway on 127.0.0.1, each in its own process group.

A ``Fleet`` starts ``kvgate worker --engine sim`` processes and one ``kvgate serve`` at a time (plus, for
multi-replica runs, more gateway replicas: ``start_replica``), waits for their HTTP endpoints, resets the workers'
prefix caches between runs, can ``kill`` a process (SIGKILL) and ``restart`` it with the same command line (same
ports), and stops everything it started: SIGTERM to the process group, then SIGKILL after a grace period.
``stop()`` is idempotent and safe to call from a ``finally`` after Ctrl-C.
Nothing here listens on anything but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from loadgen.errors import FleetError
from loadgen.ports import PortPicker

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class WorkerSpec(msgspec.Struct, frozen=True):
    """How to start one sim worker.

    Attributes:
        worker_id: id in the gateway config.
        num_gpu_blocks: GPU KV blocks.
        num_cpu_blocks: CPU-tier blocks (0: none).
        block_size: tokens per block.
        time_scale: wall seconds per simulated second (the worker's ``--time-scale``).
        role: ``prefill``, ``decode`` or ``both`` (the worker's ``--role``; the gateway entry's ``role``).
    """

    worker_id: str
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    time_scale: float
    role: str = "both"


class ManagedProcess(msgspec.Struct):
    """A started process: its name, HTTP base URL, log file, handle, command line and environment additions (for
    ``Fleet.restart``)."""

    name: str
    url: str
    log_path: Path
    popen: Any
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    argv: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] | None = None
    """Variables set over the fleet's environment for this process (``None``: none)."""
    ready_path: str = "/ready"
    """What ``wait_ready`` polls on a router (a peer router answers ``/health``)."""
    stop_grace_s: float = 5.0
    """How long a stop waits after SIGTERM before SIGKILL, seconds (a gateway: ``GATEWAY_STOP_GRACE_S``)."""


GATEWAY_STOP_GRACE_S = 20.0
"""SIGTERM to SIGKILL for a kvgate gateway, seconds: more than its graceful stop takes (``listen.shutdown_grace_s``,
10 s by default, for the requests in flight, then 2 s for the streams it ends and 2 s for the handlers left:
``router.drain``), so a graceful restart is never a ``kill -9`` that cuts the streams still relayed."""


def _kvgate_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "router.cli", *args]


class Fleet:
    """Sim workers plus a gateway, started and stopped as one.

    Args:
        log_dir: where each process's stdout/stderr goes (``<name>.log``).
        model: the served model name.
        startup_timeout_s: how long to wait for a process's HTTP endpoint.
        reset_path: the worker endpoint that clears its prefix cache (POST).
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        model: str = "sim",
        startup_timeout_s: float = 30.0,
        reset_path: str = "/reset_prefix_cache",
    ) -> None:
        self._log_dir = log_dir
        self._model = model
        self._startup_timeout_s = startup_timeout_s
        self._reset_path = reset_path
        self._ports = PortPicker()
        self.workers: list[ManagedProcess] = []
        self.worker_extra: dict[str, Any] = {}
        """Keys merged into every worker's entry of the gateway config (e.g. ``{"pools": ["MOONCAKE"]}``)."""
        self.gateway: ManagedProcess | None = None
        self.replicas: list[ManagedProcess] = []
        self.roles: dict[str, str] = {}
        self.time_scales: dict[str, float] = {}
        """Each started worker's ``--time-scale`` (wall seconds per simulated second), by worker id."""
        self.enable_gateway_time_scale = True
        """List each paced worker (time scale above 0) in the gateway config with its ``time_scale``, so that the
        gateway's cost model drains queued prefill in the worker's seconds and calibrates on them; False lists every
        worker at the default 1.0, which drains a worker's queue per wall second (``time_scale`` times too slowly for
        a sim worker run faster than real time)."""

    def _spawn(self, name: str, argv: list[str], url: str, env: dict[str, str] | None = None) -> ManagedProcess:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(  # noqa: S603 - our own console script, no shell
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: stopped as a group, spared the terminal's Ctrl-C
                cwd=Path(__file__).resolve().parent.parent,
                env=None if env is None else {**os.environ, **env},
            )
        logger.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return ManagedProcess(name=name, url=url, log_path=log_path, popen=popen, argv=list(argv), env=env)

    def start_workers(self, specs: Sequence[WorkerSpec], extra_args: Sequence[str] = ()) -> None:
        """Start one sim worker per spec (not waiting; see ``wait_ready``)."""
        for spec in specs:
            port, events_port, replay_port = self._ports.ports(3)
            argv = _kvgate_command(
                "worker",
                "--worker-id",
                spec.worker_id,
                "--model",
                self._model,
                "--engine",
                "sim",
                "--host",
                HOST,
                "--port",
                str(port),
                # A wildcard endpoint makes the worker's PUB bind (vLLM's rule); the gateway's SUB connects.
                "--kv-events-endpoint",
                f"tcp://*:{events_port}",
                "--replay-endpoint",
                f"tcp://*:{replay_port}",
                "--num-gpu-blocks",
                str(spec.num_gpu_blocks),
                "--num-cpu-blocks",
                str(spec.num_cpu_blocks),
                "--block-size",
                str(spec.block_size),
                "--time-scale",
                repr(spec.time_scale),
                "--role",
                spec.role,
                *extra_args,
            )
            self.roles[spec.worker_id] = spec.role
            self.time_scales[spec.worker_id] = spec.time_scale
            proc = self._spawn(spec.worker_id, argv, f"http://{HOST}:{port}")
            proc.events_endpoint = f"tcp://{HOST}:{events_port}"
            proc.replay_endpoint = f"tcp://{HOST}:{replay_port}"
            self.workers.append(proc)

    def gateway_config(
        self, policy: dict[str, Any], port: int, block_size: int, pd: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The gateway YAML (as builtins) for the running workers and ``policy``; ``pd``: the model's ``pd``
        section (served disaggregated over the workers' roles). A paced worker's entry carries its ``time_scale``
        unless ``enable_gateway_time_scale`` is off (an unpaced one, time scale 0, has no clock to give)."""
        model: dict[str, Any] = {"name": self._model, "block_size": block_size}
        if pd is not None:
            model["pd"] = pd
        time_scales = self.time_scales if self.enable_gateway_time_scale else {}
        return {
            "listen": {"host": HOST, "port": port},
            "models": [model],
            "workers": [
                {
                    "id": w.name,
                    "url": w.url,
                    "model": self._model,
                    "events_endpoint": w.events_endpoint,
                    "replay_endpoint": w.replay_endpoint,
                    "role": self.roles.get(w.name, "both"),
                    **({"time_scale": time_scales[w.name]} if time_scales.get(w.name, 0.0) > 0.0 else {}),
                    **self.worker_extra,
                }
                for w in self.workers
            ],
            "policy": policy,
            "admin": {"disable_auth": True, "num_recent_decisions": 1024},
        }

    def _spawn_gateway(
        self, name: str, policy: dict[str, Any], block_size: int, extra_config: dict[str, Any] | None,
        serve_args: Sequence[str] = (), env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        port = self._ports.port()
        config = self.gateway_config(policy, port, block_size)
        config.update(extra_config or {})
        config_path = self._log_dir / f"{name}-{policy.get('name', 'policy')}.yaml"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = self._spawn(name, _kvgate_command("serve", "--config", str(config_path), *serve_args),
                           f"http://{HOST}:{port}", env=env)
        proc.stop_grace_s = GATEWAY_STOP_GRACE_S
        return proc

    def start_gateway(
        self, policy: dict[str, Any], block_size: int, extra_config: dict[str, Any] | None = None,
        serve_args: Sequence[str] = (), env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        """Write the gateway config for ``policy`` and start ``kvgate serve`` (stopping a previous gateway).

        Args:
            policy: the ``policy`` section.
            block_size: the model's block size.
            extra_config: top-level sections put into the config as they are (``sessions``, ``health``...).
            serve_args: more ``kvgate serve`` arguments (``--processes N``).
            env: variables set for the gateway process over this one's environment (``PYTHONMALLOC``...).
        """
        self.stop_gateway()
        self.gateway = self._spawn_gateway("gateway", policy, block_size, extra_config, serve_args, env)
        return self.gateway

    def start_replica(
        self, name: str, policy: dict[str, Any], block_size: int, extra_config: dict[str, Any] | None = None
    ) -> ManagedProcess:
        """Start one more gateway replica (``name``), as ``start_gateway`` does; ``wait_ready`` waits for it and
        ``stop`` stops it."""
        replica = self._spawn_gateway(name, policy, block_size, extra_config)
        self.replicas.append(replica)
        return replica

    def kill(self, proc: ManagedProcess) -> None:
        """SIGKILL ``proc``'s process group (``kill -9``) and reap it."""
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)

    def restart(self, proc: ManagedProcess, *, graceful: bool = True) -> None:
        """Stop ``proc`` (SIGTERM, or SIGKILL when not ``graceful``) and start its command line again, on the same
        ports; ``proc`` then handles the new process (not waiting: see ``wait_ready``)."""
        if graceful:
            self._stop(proc)
        else:
            self.kill(proc)
        proc.popen = self._spawn(proc.name, proc.argv, proc.url, env=proc.env).popen  # same ``stop_grace_s``

    def start_router(self, name: str, argv: Sequence[str], port: int, *, ready_path: str = "/health",
                     env: dict[str, str] | None = None) -> ManagedProcess:
        """Start another router in front of the running workers (a peer of kvgate's gateway, listening on
        ``127.0.0.1:port``; stopping a previous gateway first). It takes the gateway's place: ``wait_ready`` polls
        its ``ready_path`` and ``stop_gateway`` stops it."""
        self.stop_gateway()
        self.gateway = self._spawn(name, list(argv), f"http://{HOST}:{port}", env=env)
        self.gateway.ready_path = ready_path
        return self.gateway

    def free_port(self) -> int:
        """A free port on 127.0.0.1 (for a peer router's listeners)."""
        return self._ports.port()

    async def _wait_http(self, session: aiohttp.ClientSession, proc: ManagedProcess, path: str) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        last_error = "no answer"
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise FleetError(
                    f"exited with status {proc.popen.returncode} during startup; see {proc.log_path}", name=proc.name
                )
            try:
                async with session.get(proc.url + path, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    if resp.status == 200:
                        return
                    last_error = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last_error = type(exc).__name__
            await asyncio.sleep(0.2)
        raise FleetError(
            f"not ready after {self._startup_timeout_s} s ({last_error}); see {proc.log_path}", name=proc.name
        )

    async def wait_ready(self) -> None:
        """Wait until every worker answers ``/health`` and every gateway (if started) answers ``/ready``.

        Raises:
            FleetError: a process exited or did not answer in time.
        """
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._wait_http(session, w, "/health") for w in self.workers))
            gateways = [self.gateway, *self.replicas] if self.gateway is not None else self.replicas
            await asyncio.gather(*(self._wait_http(session, g, g.ready_path) for g in gateways))

    async def reset_caches(self) -> None:
        """Clear every worker's prefix cache (POST ``reset_path``).

        Raises:
            FleetError: a worker refused or could not be reached.
        """
        async with aiohttp.ClientSession() as session:
            for w in self.workers:
                status = 0
                for _ in range(50):  # 409 while requests still hold blocks: retry for up to ~10 s
                    try:
                        async with session.post(  # our sim workers: parked prefill legs of a finished run go too
                            w.url + self._reset_path, params={"release_parked": "true"},
                            timeout=aiohttp.ClientTimeout(total=10),
                        ) as resp:
                            status = resp.status
                    except aiohttp.ClientError as exc:
                        raise FleetError(f"cache reset failed: {exc}", name=w.name) from exc
                    if status != 409:
                        break
                    await asyncio.sleep(0.2)
                if status != 200:
                    raise FleetError(f"cache reset answered HTTP {status}", name=w.name)

    @staticmethod
    def _stop(proc: ManagedProcess) -> None:
        popen, grace_s = proc.popen, proc.stop_grace_s
        if popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.1f s; killing", proc.name, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=grace_s)

    def stop_gateway(self) -> None:
        """Stop the gateway if one runs."""
        if self.gateway is not None:
            self._stop(self.gateway)
            self.gateway = None

    def stop(self) -> None:
        """Stop everything this fleet started (idempotent)."""
        self.stop_gateway()
        for replica in self.replicas:
            self._stop(replica)
        self.replicas = []
        for w in self.workers:
            self._stop(w)
        self.workers = []
