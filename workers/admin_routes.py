"""The worker's operations routes: health, load, the KV snapshot, prefix-cache reset, Prometheus metrics, and the
debug routes (memory report, fault injection: ``workers.faults``). Shapes as ``workers.server``'s module docstring
says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import prometheus_client
from aiohttp import web

from common.process_stats import MemoryQueryError, malloc_trim, memory_report_for_query
from workers.faults import Faults
from workers.protocol import error_body
from workers.worker import LOOP_KEY, WORKER_KEY, Worker, error_response, json_response

logger = logging.getLogger(__name__)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the engine loop runs, 503 otherwise."""
    task = request.app.get(LOOP_KEY)
    if task is None or task.done():
        return web.Response(status=503)
    return web.Response(status=200)


def load_info(worker: Worker) -> dict[str, Any]:
    """The load endpoint's JSON (also used by the bench)."""
    core = worker.core
    kv = core.kv
    total = {"GPU": kv.gpu.num_blocks}
    if kv.cpu is not None:
        total["CPU"] = kv.cpu.num_blocks
    free = kv.free_blocks_by_medium()
    pool: dict[str, int] | None = None
    if kv.pool is not None:
        pool = kv.pool.block_counts()
        if "num_free_blocks" in pool:
            free["MOONCAKE"] = pool["num_free_blocks"]
            total["MOONCAKE"] = pool["num_free_blocks"] + pool["num_used_blocks"]
    out = {
        "worker_id": worker.config.worker_id,
        "model": worker.config.model,
        "start_id": worker.start_id,
        "num_running_requests": core.scheduler.num_running,
        "num_waiting_requests": core.scheduler.num_waiting,
        "kv_usage": kv.gpu.usage,
        "num_free_blocks": free,
        "num_total_blocks": total,
        "num_gpu_cached_blocks": kv.gpu.num_cached_blocks,
        "block_size": kv.block_size,
        "last_event_seq": core.last_published_seq,
        "role": worker.config.role,
        "kv_transfer": {
            "engine_id": worker.prefill_handoff.engine_id,
            "num_receiving_requests": len(core.scheduler.receiving),
            "num_reserved_transfer_blocks": core.scheduler.num_receiving_blocks,
            "num_parked_requests": len(core.scheduler.parked),
            "num_parked_blocks": core.scheduler.num_parked_blocks,
            "num_waiting_pulls": worker.prefill_handoff.num_waiting_pulls,
            "num_served_transfers": worker.prefill_handoff.num_pulled,
            "num_expired_transfers": worker.prefill_handoff.num_expired,
            "num_pulled_transfers": worker.decode_handoff.num_pulls,
            "num_pulled_blocks": worker.decode_handoff.num_pulled_blocks,
            "num_failed_pulls": worker.decode_handoff.num_failed,
            "num_refused_transfers": worker.decode_handoff.num_refused,
        },
    }
    if pool is not None:
        out["pool"] = pool
    return out


async def load(request: web.Request) -> web.Response:
    """``GET /load``."""
    return json_response(load_info(request.app[WORKER_KEY]))


async def snapshot(request: web.Request) -> web.Response:
    """``GET /kv/snapshot`` (module docstring)."""
    worker = request.app[WORKER_KEY]
    core = worker.core
    core.flush_events()
    events = core.kv.snapshot_events()
    body = worker.encoder.encode(events, time.time(), 0)
    headers = {
        "x-kvgate-last-seq": str(core.last_published_seq),
        "x-kvgate-start-id": worker.start_id,
        "x-kvgate-block-size": str(core.kv.block_size),
    }
    return web.Response(body=body, content_type="application/msgpack", headers=headers)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """``POST /reset_prefix_cache``: 200 when cleared, 409 while requests hold blocks. The replay buffer keeps only
    the batch of the ``AllBlocksCleared`` (``KVEventPublisher.drop_buffered_before``) and the freed memory goes back
    to the kernel (``malloc_trim``, in a thread), so the worker's RSS returns to what it was before its load.

    ``?release_parked=true``: first drop the prefill legs parked for a decode side that never pulled them (their
    blocks are otherwise held until ``kv-transfer.abort-request-timeout-s``, 480 s by default, as vLLM's
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), for a fleet being reset between runs; a later pull of one answers 404.
    Any other value of it is a 400."""
    worker = request.app[WORKER_KEY]
    core = worker.core
    release = request.query.get("release_parked", "false")
    if release not in ("true", "false"):
        return json_response(error_body(f"release_parked must be true or false, got {release!r}",
                                        "invalid_request_error", "release_parked", None), 400)  # fmt: skip
    if release == "true":
        worker.prefill_handoff.release_parked()
    if not core.kv.reset_prefix_cache():
        return json_response(error_body("requests are using KV blocks; retry when idle", "conflict", None, None), 409)
    core.flush_events()
    if core.publisher is not None and core.last_published_seq >= 0:
        core.publisher.drop_buffered_before(core.last_published_seq)
    await asyncio.to_thread(malloc_trim)
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics`` (Prometheus text format)."""
    worker = request.app[WORKER_KEY]
    m, wid, core = worker.metrics, worker.config.worker_id, worker.core
    m.running.labels(wid).set(core.scheduler.num_running)
    m.waiting.labels(wid).set(core.scheduler.num_waiting)
    m.kv_usage.labels(wid).set(core.kv.gpu.usage)
    for medium, n in core.kv.free_blocks_by_medium().items():
        m.free_blocks.labels(wid, medium).set(n)
    m.evicted_blocks.labels(wid).set(core.kv.gpu.num_evicted_blocks)
    m.restored_blocks.labels(wid).set(core.kv.num_restored_blocks)
    m.preemptions.labels(wid).set(core.scheduler.num_preemptions)
    if core.kv.pool is not None:
        m.pool_reads.labels(wid).set(core.kv.pool.num_reads)
        m.pool_read_wall_seconds.labels(wid).set(core.kv.pool.read_wall_s)
        m.pool_short_reads.labels(wid).set(core.kv.num_short_reads)
    return web.Response(
        body=prometheus_client.generate_latest(m.registry),
        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )


async def debug_memory(request: web.Request) -> web.Response:
    """``GET /debug/memory?limit=N&group_by=lineno|traceback&trim=true&collect=true``: the top ``N`` (25) allocation
    sites and the C heap (``common.process_stats.memory_report_for_query``); a ``limit`` not an integer, a
    ``group_by`` not one of the two or a ``trim`` or ``collect`` not ``true``/``false`` (``1``/``0``) is a 400
    naming it, as on the gateway."""
    try:
        report = memory_report_for_query(request.query)
    except MemoryQueryError as exc:
        return error_response(request.app[WORKER_KEY], 400, str(exc), param=exc.param)
    return json_response(report)


async def get_faults(request: web.Request) -> web.Response:
    """``GET /debug/faults``: the faults in force."""
    return json_response(msgspec.to_builtins(request.app[WORKER_KEY].faults))


async def set_faults(request: web.Request) -> web.Response:
    """``POST /debug/faults``: replace the faults in force (``workers.faults.Faults``); 400 for a bad body."""
    worker = request.app[WORKER_KEY]
    try:
        faults = msgspec.json.decode(await request.read() or b"{}", type=Faults)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        return error_response(worker, 400, f"bad faults: {exc}")
    worker.faults = faults
    publisher = worker.core.publisher
    if publisher is not None:
        publisher.set_faults(drop_sends=faults.drop_events, refuse_replay=faults.refuse_replay)
    logger.info("fault injection: %s", faults)
    return json_response(msgspec.to_builtins(faults))
