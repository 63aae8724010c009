"""The errors of a disaggregated request (``router.pd``) that a worker's answer or the fleet's size make: a
prefill worker's refusal relayed as the client's error, and the 400 of a request no decode worker could hold."""

from __future__ import annotations

import msgspec

from policies.base import RequestView
from router.errors import GatewayError, InvalidFieldError, UpstreamError, UpstreamRefusedError
from router.request_view import ParsedRequest

__all__ = ["MAX_REFUSAL_MESSAGE_CHARS", "prefill_refusal", "too_large_error"]

MAX_REFUSAL_MESSAGE_CHARS = 1000
"""Longest worker error message relayed in an ``UpstreamRefusedError`` (the rest is cut)."""


def prefill_refusal(worker_id: str, status: int, answer: bytes) -> GatewayError:
    """A prefill worker's answer that is neither 200 nor 5xx as the client's error: a 4xx with the worker's
    OpenAI error fields (its message, type, param and code when its body has them), anything else a 502."""
    text = answer[:300].decode(errors="replace")
    if not 400 <= status < 500:
        return UpstreamError(f"prefill worker {worker_id} answered {status}: {text}", worker_id=worker_id)
    try:
        decoded = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        decoded = None
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return UpstreamRefusedError(
            f"prefill worker {worker_id} refused the request ({status}): {text}",
            status=status, error_type="invalid_request_error", param=None, code=None, worker_id=worker_id,
        )

    def text_field(name: str) -> str | None:
        value = error.get(name)
        return value[:MAX_REFUSAL_MESSAGE_CHARS] if isinstance(value, str) else None

    return UpstreamRefusedError(
        error["message"][:MAX_REFUSAL_MESSAGE_CHARS],
        status=status,
        error_type=text_field("type") or "invalid_request_error",
        param=text_field("param"),
        code=text_field("code"),
        worker_id=worker_id,
    )


def too_large_error(parsed: ParsedRequest, view: RequestView, num_blocks: int, num_capacity: int) -> GatewayError:
    """The 400 of a request that no decode worker could ever hold (``PDPolicy.never_fits``): ``param`` is the
    prompt (``prompt`` / ``messages``) when its own blocks are too many already, else ``max_tokens``."""
    b = view.block_size
    prompt_too_large = -(-view.num_prompt_tokens // b) > num_capacity
    param = ("messages" if parsed.kind == "chat" else "prompt") if prompt_too_large else "max_tokens"
    return InvalidFieldError(
        f"the request needs {num_blocks} KV blocks on a decode worker ({view.num_prompt_tokens} prompt + "
        f"{view.num_max_output_tokens} output tokens, {b} per block); the largest decode worker can hold "
        f"{num_capacity}",
        param=param,
        code="context_length_exceeded",
    )
