"""The worker's OpenAI API: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models``,
``/tokenize``; the generation path of one request, plain or either leg of a disaggregated one
(``workers.handoff.classify_leg``; the handoff halves are ``workers.pd_routes``'). Framing and usage as
``workers.server``'s module docstring says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from common.errors import InvalidRequestError
from common.pd_protocol import BootstrapRequest, remote_prefill_cached_tokens
from common.tokenization import encode_chat, encode_prompt, normalize_messages
from workers.core import RequestStream
from workers.engines.base import SamplingParams
from workers.errors import ContextLengthError
from workers.faults import fail_after_headers
from workers.handoff import Leg, classify_leg
from workers.pd_routes import park, receive
from workers.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    IncrementalDetokenizer,
    SamplingFields,
    TokenizeRequest,
    decode_request,
    stop_strings,
    validate_sampling,
)
from workers.scheduler import Request
from workers.worker import ENGINE_TTFT_KEY, WORKER_ID_HEADER, WORKER_KEY, Worker, error_response, json_response

logger = logging.getLogger(__name__)


def _check_model(worker: Worker, model: str | None) -> web.Response | None:
    if model is not None and model != worker.config.model:
        return error_response(worker, 404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return None


def _make_request(
    worker: Worker,
    request_id: str,
    prompt_ids: list[int],
    req: SamplingFields,
    max_tokens: int | None,
    leg: Leg = Leg.PLAIN,
) -> Request:
    """Validate limits and build the scheduler request.

    Raises:
        InvalidRequestError: empty prompt, bad ``max_tokens``, over the context limit.
    """
    validate_sampling(req)
    sched = worker.config.scheduler
    if not prompt_ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
    n = len(prompt_ids)
    if n >= sched.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {sched.max_model_len} tokens; the prompt has {n} tokens.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and n + max_tokens > sched.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {sched.max_model_len} tokens; {n} prompt tokens plus "
            f"max_tokens {max_tokens} exceed it.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    kvc = worker.config.kv_cache
    if -(-(n + 1) // kvc.block_size) > kvc.num_gpu_blocks:
        raise ContextLengthError(
            f"the prompt needs more KV blocks than the worker has ({kvc.num_gpu_blocks})", param="prompt"
        )
    limit = max_tokens if max_tokens is not None else min(sched.default_max_tokens, sched.max_model_len - n)
    stop_ids = frozenset(req.stop_token_ids or ())
    vocab = worker.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in stop_ids):
        raise InvalidRequestError("stop_token_ids out of range", param="stop_token_ids")
    seed = req.seed if req.seed is not None else worker.config.timing.seed
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=seed,
    )
    if leg is Leg.SGLANG_PREFILL:
        limit = 1  # an SGLang prefill server computes the prompt and one token, whatever max_tokens says
    elif leg is Leg.VLLM_PREFILL and req.stream:
        raise InvalidRequestError(
            "a prefill leg (kv_transfer_params.do_remote_decode) must not stream: its answer carries the "
            "kv_transfer_params for the decode leg",
            param="stream",
        )
    return Request(
        request_id,
        prompt_ids,
        limit,
        sampling,
        ignore_eos=req.ignore_eos,
        stop_token_ids=stop_ids,
        cache_salt=req.cache_salt,
        park_on_finish=leg.is_prefill,
    )


def _leg(worker: Worker, body: SamplingFields) -> Leg:
    """Which PD leg ``body`` is on this worker (``workers.handoff.classify_leg``)."""
    bootstrap = BootstrapRequest(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)
    return classify_leg(worker.config.role, body.kv_transfer_params, bootstrap)


def _usage(req: Request, body: SamplingFields) -> dict[str, Any]:
    """The answer's ``usage``. A vLLM decode leg whose params carry the prefill side's hits reports those as its
    ``cached_tokens``, as vLLM 0.32's decode worker does (``common.pd_protocol.remote_prefill_cached_tokens``)."""
    completion = req.num_output_tokens
    cached = remote_prefill_cached_tokens(body.kv_transfer_params)
    return {
        "prompt_tokens": req.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": req.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached if cached is not None else req.num_cached_tokens or 0},
    }


async def _generate(
    worker: Worker,
    http_request: web.Request,
    req: Request,
    body: SamplingFields,
    is_chat: bool,
    leg: Leg = Leg.PLAIN,
) -> web.StreamResponse:
    core = worker.core
    faults = worker.faults
    if faults.delay_s > 0:
        await asyncio.sleep(faults.delay_s)
    if faults.fail_after_headers:
        return await fail_after_headers(http_request, bool(body.stream))
    if leg.is_decode:
        received = await receive(worker, req, body, leg)
        if isinstance(received, web.Response):
            return received
        stream = received
    else:
        stream = core.add_request(req)
    added_s = time.monotonic()
    detok = IncrementalDetokenizer(worker.tokenizer, stop_strings(body.stop))
    created = int(time.time())
    model = worker.config.model
    rid = req.request_id
    finished = False
    room = body.bootstrap_room if leg is Leg.SGLANG_PREFILL else None
    try:
        if body.stream:
            response = await _stream_response(worker, http_request, stream, detok, body, is_chat, created, added_s)
            if leg.is_prefill:
                park(worker, http_request, req, room)
            finished = True
            return response
        text_parts: list[str] = []
        finish_reason = "abort"
        while True:
            out = await stream.queue.get()
            done = out.finish_reason is not None
            text_parts.append(detok.add(out.new_token_ids, done))
            if detok.stopped and not done:
                core.finish_request(rid, "stop")
                done, out.finish_reason = True, "stop"
            if done:
                finish_reason = out.finish_reason or "stop"
                break
        finished = True
        _record(worker, req, finish_reason)
        text = "".join(text_parts)
        if is_chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        answer: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(req, body),
        }
        if leg.is_prefill:
            answer["kv_transfer_params"] = park(worker, http_request, req, room)
        return json_response(answer)
    finally:
        if not finished:
            core.finish_request(rid, "abort")
            if leg.is_prefill and not worker.prefill_handoff.is_registered(rid):
                core.release_transfer_reader(rid)  # parked by the engine, but nobody will learn where
                if room is not None:
                    worker.prefill_handoff.fail_room(room, "aborted")


def _record(worker: Worker, req: Request, finish_reason: str) -> None:
    m, wid = worker.metrics, worker.config.worker_id
    m.requests.labels(wid, finish_reason).inc()
    m.prompt_tokens.labels(wid).inc(req.num_prompt_tokens)
    m.cached_tokens.labels(wid).inc(req.num_cached_tokens or 0)
    gpu, cpu, pool = req.num_cached_tokens_by_medium
    for medium, num in (("GPU", gpu), ("CPU", cpu), ("MOONCAKE", pool)):
        m.cached_tokens_by_medium.labels(wid, medium).inc(num)
    if cpu or pool:
        m.restores.labels(wid).inc()
    m.generation_tokens.labels(wid).inc(req.num_output_tokens)


async def _stream_response(
    worker: Worker,
    http_request: web.Request,
    stream: RequestStream,
    detok: IncrementalDetokenizer,
    body: SamplingFields,
    is_chat: bool,
    created: int,
    added_s: float,
) -> web.StreamResponse:
    """Stream the answer as SSE; with ``stream_options.include_usage`` the usage chunk also carries
    ``ENGINE_TTFT_KEY``: wall seconds from the request entering the engine to its first text chunk being written
    (the engine's part of the TTFT; the rest, HTTP, tokenization and any router in front, runs in real time)."""
    req = stream.request
    rid = req.request_id
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       WORKER_ID_HEADER: worker.config.worker_id})
    await resp.prepare(http_request)
    base: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if is_chat else "text_completion",
        "created": created,
        "model": worker.config.model,
    }
    enc = msgspec.json.encode

    def chunk(delta_text: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        if is_chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish_reason}
        payload = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return b"data: " + enc(payload) + b"\n\n"

    # As vLLM does, the chat role chunk goes out with the first output (after prefill), so TTFT measured on a
    # streamed chat is the time to the first generated token.
    is_role_pending = is_chat
    first_text_s: float | None = None
    try:
        while True:
            out = await stream.queue.get()
            if is_role_pending:
                await resp.write(chunk("", None, role=True))
                is_role_pending = False
            done = out.finish_reason is not None
            text = detok.add(out.new_token_ids, done)
            if detok.stopped and not done:
                worker.core.finish_request(rid, "stop")
                done, out.finish_reason = True, "stop"
            if text and first_text_s is None:
                first_text_s = time.monotonic()
            if text and not done:
                await resp.write(chunk(text, None))
            if done:
                if text:
                    await resp.write(chunk(text, None))
                await resp.write(chunk(None if is_chat else "", out.finish_reason))
                _record(worker, req, out.finish_reason or "stop")
                break
        if include_usage:
            final: dict[str, Any] = {**base, "choices": [], "usage": _usage(req, body)}
            if first_text_s is not None:
                final[ENGINE_TTFT_KEY] = first_text_s - added_s
            await resp.write(b"data: " + enc(final) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream: the caller's ``finally`` frees the request's blocks.
        logger.debug("client disconnected mid-stream: request_id=%s", rid)
    return resp


# handlers --------------------------------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    worker = request.app[WORKER_KEY]
    body = decode_request(await request.read(), CompletionRequest)
    if (bad := _check_model(worker, body.model)) is not None:
        return bad
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a string, a list of token ids, or one string", param="prompt")
    ids = encode_prompt(worker.tokenizer, prompt)
    leg = _leg(worker, body)
    req = _make_request(worker, worker.next_request_id("cmpl"), ids, body, body.max_tokens, leg)
    return await _generate(worker, request, req, body, is_chat=False, leg=leg)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    worker = request.app[WORKER_KEY]
    body = decode_request(await request.read(), ChatCompletionRequest)
    if (bad := _check_model(worker, body.model)) is not None:
        return bad
    messages = normalize_messages(body.messages)
    ids = encode_chat(worker.tokenizer, worker.template, messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    leg = _leg(worker, body)
    req = _make_request(worker, worker.next_request_id("chatcmpl"), ids, body, max_tokens, leg)
    return await _generate(worker, request, req, body, is_chat=True, leg=leg)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    worker = request.app[WORKER_KEY]
    entry = {
        "id": worker.config.model,
        "object": "model",
        "created": 0,
        "owned_by": "kvgate",
        "root": worker.config.model,
        "max_model_len": worker.config.scheduler.max_model_len,
    }
    return json_response({"object": "list", "data": [entry]})


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: the exact prompt tokens the worker would use."""
    worker = request.app[WORKER_KEY]
    body = decode_request(await request.read(), TokenizeRequest)
    if (bad := _check_model(worker, body.model)) is not None:
        return bad
    if body.messages is not None:
        ids = encode_chat(
            worker.tokenizer, worker.template, normalize_messages(body.messages), body.add_generation_prompt
        )
    elif body.prompt is not None:
        if isinstance(body.prompt, list) and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in body.prompt
        ):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        ids = encode_prompt(worker.tokenizer, body.prompt)
    else:
        raise InvalidRequestError("give 'prompt' or 'messages'", param="prompt")
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": worker.config.scheduler.max_model_len})
