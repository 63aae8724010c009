"""The worker's disaggregation routes and the two halves of a handoff its generation path calls.

``park`` registers a finished prefill leg's parked blocks with ``workers.handoff.PrefillHandoff`` (the
``kv_transfer_params`` its answer carries); ``receive`` is the decode leg's half: reserve the prompt's blocks (503
``kv_transfer_refused`` with ``Retry-After`` when it cannot), pull the missing ones from the prefill side (502
``kv_transfer_failed``), register them as cached. ``POST /kv/pull`` and ``/kv/pull/done`` serve the prefill side of
a pull (``workers.handoff``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from workers.core import RequestStream
from workers.handoff import Leg, PullRequest, TransferError
from workers.protocol import SamplingFields, decode_request, error_body
from workers.scheduler import Request
from workers.worker import WORKER_KEY, Worker, error_response, json_response


def local_address(http_request: web.Request) -> tuple[str, int]:
    """The host and port this request reached the worker on."""
    sockname = http_request.transport.get_extra_info("sockname") if http_request.transport else None
    if sockname:
        return str(sockname[0]), int(sockname[1])
    return http_request.url.host or "127.0.0.1", http_request.url.port or 80


def park(worker: Worker, http_request: web.Request, req: Request, room: int | None) -> dict[str, Any] | None:
    """Register a parked prefill leg with the handoff; its ``kv_transfer_params`` (``None``: not parked)."""
    if req.request_id not in worker.core.scheduler.parked:
        if room is not None:
            worker.prefill_handoff.fail_room(room, f"finished with {req.finish_reason}")
        return None
    host, port = local_address(http_request)
    return worker.prefill_handoff.park(req, room, host, port)


async def receive(worker: Worker, req: Request, body: SamplingFields, leg: Leg) -> RequestStream | web.Response:
    """The decode leg's handoff: reserve the blocks, pull the missing ones, register them (module docstring).

    Returns:
        The request's stream, ready to run, or the error response (503 refused, 502 pull failed).
    """
    core = worker.core
    wait_s = worker.config.kv_transfer.receive_wait_s
    stream = await core.add_receiving_within(req, wait_s)
    if stream is None:
        worker.decode_handoff.num_refused += 1
        sched = core.scheduler
        when = f"within {wait_s:g} s" if wait_s > 0 else "now"
        if core.is_closing:
            when = "now: the worker is shutting down"
        msg = (
            f"decode worker {worker.config.worker_id} cannot reserve KV blocks for a {req.num_prompt_tokens}-token "
            f"prompt {when} ({core.kv.gpu.num_free_blocks} free blocks, {sched.num_running} of "
            f"{sched.config.max_num_seqs} sequences running)"
        )
        resp = error_response(worker, 503, msg, None, "kv_transfer_refused")
        resp.headers["Retry-After"] = "1"
        return resp
    bs = core.kv.block_size
    first = req.num_computed_tokens // bs
    expected = -(-req.num_prompt_tokens // bs) - first
    handoff = worker.decode_handoff
    if leg is Leg.VLLM_DECODE:
        params = body.kv_transfer_params or {}
        base_url = f"http://{params['remote_host']}:{params['remote_port']}"
        rid = str(params["remote_request_id"])
        pull = PullRequest(handoff.engine_id, remote_request_id=rid, first_block_index=first)
    else:
        base_url = f"http://{body.bootstrap_host}:{body.bootstrap_port}"
        pull = PullRequest(handoff.engine_id, bootstrap_room=body.bootstrap_room, first_block_index=first)
    try:
        await handoff.pull(base_url, pull, expected, req.num_prompt_tokens)
    except TransferError as exc:
        core.finish_request(req.request_id, "abort")
        return error_response(worker, exc.status, exc.message, "kv_transfer_params", exc.code)
    except BaseException:
        core.finish_request(req.request_id, "abort")
        raise
    if not core.finish_receiving(req.request_id):
        return error_response(worker, 502, "the request was aborted while its KV arrived", None, "kv_transfer_failed")
    return stream


async def kv_pull(request: web.Request) -> web.Response:
    """``POST /kv/pull`` (``workers.handoff``)."""
    worker = request.app[WORKER_KEY]
    pull = decode_request(await request.read(), PullRequest)
    try:
        desc = await worker.prefill_handoff.begin_pull(pull)
    except TransferError as exc:
        return json_response(error_body(exc.message, "kv_transfer_error", None, exc.code), exc.status)
    return json_response(desc)


async def kv_pull_done(request: web.Request) -> web.Response:
    """``POST /kv/pull/done`` (``workers.handoff``)."""
    worker = request.app[WORKER_KEY]
    pull = decode_request(await request.read(), PullRequest)
    return json_response({"released": worker.prefill_handoff.end_pull(pull)})
