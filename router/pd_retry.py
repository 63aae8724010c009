"""The decode leg's retry on the disaggregated path (vLLM's protocol), and the outcome a PD record names.

The prefill side frees a request's parked blocks once a decode worker pulled them (the reference worker on
``POST /kv/pull/done``, ``workers/handoff.py``; vLLM's ``NixlConnector`` on the decode side's completion notice).
A decode attempt that failed after it may have pulled (its connection dropped mid-request, a 502 or 504) leaves
``kv_transfer_params`` that point at nothing, so the retry on the next decode worker gets a fresh prefill leg. Two
failures prove the parked KV untouched, and keep the first leg's params: a 503 (the decode worker refused before it
reserved or pulled: ``kv_transfer_refused``) and a worker never reached (``TransportUnreachedError``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from common.pd_protocol import remote_prefill_cached_tokens, unusable_prefill_params
from router.errors import GatewayError, TransportUnreachedError
from router.fleet import WorkerRuntime
from router.routing import RoutePlan

logger = logging.getLogger(__name__)


class DecodeRetry:
    """``Proxy.forward``'s ``retry_body`` for a vLLM decode leg (module docstring).

    Args:
        request_id: the request's id (for the log).
        body: the first decode leg's body (JSON bytes).
        plan: the decode leg's plan; a fresh leg's ``remote_prefill_cached_tokens`` becomes the retried worker's
            predicted cached tokens (its decode worker reports the new leg's hits).
        fresh_prefill: sends the prefill leg again; its ``kv_transfer_params`` (``None`` when not an object), or the
            error that ended it.
        decode_body: the decode leg's body for those params.
    """

    def __init__(
        self,
        request_id: str,
        body: bytes,
        plan: RoutePlan,
        fresh_prefill: Callable[[], Awaitable[dict[str, Any] | None | GatewayError]],
        decode_body: Callable[[dict[str, Any] | None], bytes],
    ) -> None:
        self.request_id = request_id
        self.body = body
        self.plan = plan
        self._fresh_prefill = fresh_prefill
        self._decode_body = decode_body
        self.num_fresh_legs = 0

    async def __call__(self, worker: WorkerRuntime, error: Exception | None, status: int | None) -> bytes | None:
        """The body for the retry on ``worker`` after ``error`` (``status``: the failed attempt's answer, or
        ``None``); ``None`` skips the worker (the fresh prefill leg failed)."""
        if status == 503 or isinstance(error, TransportUnreachedError):
            return self.body
        params = await self._fresh_prefill()
        if isinstance(params, GatewayError):
            logger.warning("request %s: no fresh prefill leg for the decode retry on %s: %s", self.request_id,
                           worker.worker_id, params.message)
            return None
        self.num_fresh_legs += 1
        remote = remote_prefill_cached_tokens(params)
        if remote is not None:
            self.plan.predicted_cached_tokens[worker.worker_id] = remote
        self.body = self._decode_body(params)
        return self.body


def answer_params(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill leg's JSON answer, or ``None`` when they are not an object."""
    params = answer.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def unusable_answer(answer: dict[str, Any]) -> str | None:
    """Why a prefill leg's 200 answer carries ``kv_transfer_params`` no decode worker can use, or ``None``
    (``common.pd_protocol.unusable_prefill_params``)."""
    return unusable_prefill_params(answer.get("kv_transfer_params"))
