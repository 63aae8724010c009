"""One worker process's state: its metrics, its engine core and handoffs, built from its config.

``build_worker`` makes the tokenizer, KV manager, scheduler and engine; the route modules (``workers.openai_routes``,
``workers.pd_routes``, ``workers.admin_routes``) read the ``Worker`` from the app (``WORKER_KEY``) and answer with
``json_response`` / ``error_response`` (OpenAI error JSON); ``workers.server`` assembles the app.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import prometheus_client
from aiohttp import web

from common.process_stats import register_process_collectors
from common.tokenization import ByteTokenizer, ChatTemplate, Tokenizer, check_template, load_tokenizer
from events.encode import BatchEncoder
from events.publisher import KVEventPublisher, PublisherConfig
from workers.config import WorkerConfig
from workers.core import EngineCore
from workers.engines.base import Engine
from workers.engines.sim import SimEngine
from workers.errors import ConfigError
from workers.faults import Faults
from workers.handoff import DecodeHandoff, PrefillHandoff
from workers.kv.manager import KVCacheManager
from workers.protocol import error_body
from workers.scheduler import Scheduler

WORKER_ID_HEADER = "x-worker-id"
"""Response header naming the worker that streamed the answer (a router in front relays it; the side-by-side
benchmark reads it to count each peer router's load per worker)."""
ENGINE_TTFT_KEY = "engine_ttft_wall_s"
"""Key of the streamed usage chunk (beside ``usage``; a kvgate worker extension that OpenAI clients ignore): wall
seconds from the request entering the engine to its first text chunk. A load generator replaying time-scaled sim
workers scales only this part of the TTFT, not the real-time part around it (the router's own time)."""
SAMPLE_TEXT = " the of and to a in is it you that he was for on are with as I his they be at one have this from"


class WorkerMetrics:
    """Prometheus metrics of one worker, in their own registry."""

    def __init__(self, worker_id: str) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        labels = ["worker_id"]
        r = self.registry
        self.requests = prometheus_client.Counter(
            "kvgate_worker_requests", "Finished requests", [*labels, "finish_reason"], registry=r
        )
        self.prompt_tokens = prometheus_client.Counter(
            "kvgate_worker_prompt_tokens", "Prompt tokens", labels, registry=r
        )
        self.cached_tokens = prometheus_client.Counter(
            "kvgate_worker_cached_prompt_tokens", "Prompt tokens served from any KV tier", labels, registry=r
        )
        self.cached_tokens_by_medium = prometheus_client.Counter(
            "kvgate_worker_cached_prompt_tokens_by_medium",
            "Prompt tokens served from each KV tier at admission (GPU hit, CPU restore, shared pool restore)",
            [*labels, "medium"],
            registry=r,
        )
        self.restores = prometheus_client.Counter(
            "kvgate_worker_restores", "Requests admitted with a restore from a lower tier", labels, registry=r
        )
        self.generation_tokens = prometheus_client.Counter(
            "kvgate_worker_generation_tokens", "Generated tokens", labels, registry=r
        )
        self.bad_requests = prometheus_client.Counter(
            "kvgate_worker_bad_requests", "Requests refused with 4xx", labels, registry=r
        )
        self.running = prometheus_client.Gauge("kvgate_worker_running_requests", "Running", labels, registry=r)
        self.waiting = prometheus_client.Gauge("kvgate_worker_waiting_requests", "Waiting", labels, registry=r)
        self.kv_usage = prometheus_client.Gauge(
            "kvgate_worker_kv_usage", "GPU KV blocks in use, 0..1", labels, registry=r
        )
        self.free_blocks = prometheus_client.Gauge(
            "kvgate_worker_free_blocks", "Free blocks per tier", [*labels, "medium"], registry=r
        )
        self.evicted_blocks = prometheus_client.Gauge(
            "kvgate_worker_gpu_evicted_blocks", "GPU blocks evicted since start", labels, registry=r
        )
        self.restored_blocks = prometheus_client.Gauge(
            "kvgate_worker_restored_blocks", "Blocks restored from CPU since start", labels, registry=r
        )
        self.preemptions = prometheus_client.Gauge(
            "kvgate_worker_preemptions", "Preemptions since start", labels, registry=r
        )
        self.pool_reads = prometheus_client.Gauge(
            "kvgate_worker_pool_reads", "Shared pool restore reads since start", labels, registry=r
        )
        self.pool_read_wall_seconds = prometheus_client.Gauge(
            "kvgate_worker_pool_read_wall_seconds",
            "Wall seconds the shared pool restore reads took since start (real time, not the sim timing model's)",
            labels,
            registry=r,
        )
        self.pool_short_reads = prometheus_client.Gauge(
            "kvgate_worker_pool_short_reads",
            "Shared pool restore reads that found fewer blocks than the lookup counted (evicted or corrupt in "
            "between; the hit was shortened and the rest computed)",
            labels,
            registry=r,
        )
        register_process_collectors(r)
        self.worker_id = worker_id


class Worker:
    """Everything one worker process runs, built from its config (``build_worker``)."""

    def __init__(
        self,
        config: WorkerConfig,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        core: EngineCore,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.template = template
        self.core = core
        self.start_id = uuid.uuid4().hex
        self.metrics = WorkerMetrics(config.worker_id)
        self.encoder = BatchEncoder("vllm")
        self.faults = Faults()
        self.prefill_handoff = PrefillHandoff(core, config)
        self.decode_handoff = DecodeHandoff(config)
        self._next_id = 0

    def next_request_id(self, prefix: str) -> str:
        """A request id unique within the process."""
        self._next_id += 1
        return f"{prefix}-{self.start_id[:8]}-{self._next_id}"


WORKER_KEY = web.AppKey("worker", Worker)


LOOP_KEY = web.AppKey("engine_loop", asyncio.Task[None])
"""The engine loop's task (``workers.server``); ``/health`` is 200 while it runs."""

def build_worker(config: WorkerConfig, publisher: KVEventPublisher | None = None) -> Worker:
    """Build the tokenizer, KV manager, scheduler and engine of ``config`` (sim engine).

    Raises:
        TokenizerLoadError: the tokenizer cannot be loaded.
        ConfigError: an engine this build cannot run.
    """
    tokenizer, template = load_tokenizer(config.tokenizer)
    check_template(tokenizer, template)
    kv = KVCacheManager(config.kv_cache)
    scheduler = Scheduler(config.scheduler, kv, tokenizer.eos_token_id)
    if isinstance(tokenizer, ByteTokenizer):
        vocab = list(b"abcdefghijklmnopqrstuvwxyz ")
    else:
        vocab = sorted(set(tokenizer.encode(SAMPLE_TEXT))) or [0]
    engine: Engine
    if config.engine == "torch":
        try:
            from workers.engines.torch_engine import TorchEngineConfig, build_torch_engine
        except ImportError as exc:
            raise ConfigError(f"engine 'torch' needs the gpu extra (torch, triton): {exc}") from exc
        engine = build_torch_engine(
            TorchEngineConfig(),
            num_gpu_blocks=config.kv_cache.num_gpu_blocks,
            num_cpu_blocks=config.kv_cache.num_cpu_blocks,
            block_size=config.kv_cache.block_size,
            min_vocab_size=tokenizer.vocab_size,
        )
    else:
        engine = SimEngine(config.timing, config.kv_cache.block_size, vocab, tokenizer.eos_token_id)
    core = EngineCore(scheduler, engine, publisher, config.time_scale)
    return Worker(config, tokenizer, template, core)


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as a JSON response."""
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def error_response(
    worker: Worker, status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    """An OpenAI error JSON response (``{"error": {...}}``), counted as a refused request."""
    worker.metrics.bad_requests.labels(worker.config.worker_id).inc()
    err_type = "invalid_request_error" if status == 400 else "not_found_error" if status == 404 else "error"
    return json_response(error_body(message, err_type, param, code), status)


def make_publisher(config: WorkerConfig) -> KVEventPublisher | None:
    """The KV event publisher of ``config``, or ``None`` without an endpoint."""
    if config.kv_events_endpoint is None:
        return None
    return KVEventPublisher(
        PublisherConfig(
            endpoint=config.kv_events_endpoint, replay_endpoint=config.replay_endpoint, topic=config.kv_events_topic
        )
    )
