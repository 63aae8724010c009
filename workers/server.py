"""The worker's HTTP server (aiohttp): OpenAI API plus the endpoints the gateway uses.

Endpoints::

    POST /v1/completions, /v1/chat/completions   OpenAI, streaming (SSE) or not
    GET  /v1/models                               the served model
    POST /tokenize                                {"prompt": str | [ids]} or {"messages": [...]} -> {"tokens", "count"}
    GET  /health                                  200 while the engine loop runs
    GET  /metrics                                 Prometheus text (a registry per app)
    GET  /load                                    JSON: running/waiting requests, KV usage, free blocks per tier
                                                  (``MOONCAKE`` too where the pool store reports it; ``pool``:
                                                  its used/free blocks and the blocks this worker announced),
                                                  start id (random per process start: a change means a restart)
    GET  /kv/snapshot                             the cached blocks as one KV event batch (see below)
    POST /reset_prefix_cache                      drop every cached block (409 while requests hold blocks)
    GET  /debug/memory?limit=N                    top allocation sites (``common.process_stats.memory_report``;
                                                  start with ``PYTHONTRACEMALLOC=N`` to trace)
    GET, POST /debug/faults                       fault injection, with ``enable-fault-injection`` only
                                                  (``workers.faults``)
    POST /kv/pull, /kv/pull/done                  the prefill side of a KV handoff (``workers.handoff``)

Disaggregated legs (``workers.handoff.classify_leg``): a prefill leg (vLLM ``kv_transfer_params.do_remote_decode``,
or SGLang bootstrap fields on a ``--role prefill`` worker) keeps its blocks for the decode side, and a non-streamed
vLLM prefill answer carries ``kv_transfer_params`` for the decode leg. A decode leg reserves its blocks first (503
``kv_transfer_refused`` with ``Retry-After`` when it cannot), pulls the KV, then answers like any request; a failed
pull is a 502 ``kv_transfer_failed`` (nothing was sent to the client yet).

SSE framing (as vLLM): each chunk is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. With
``stream_options.include_usage`` a last chunk with ``"choices": []`` carries ``usage``, and earlier chunks carry
``"usage": null``.

``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from any KV tier at admission, following
vLLM's rule ``block_size * min(hit_blocks, (prompt_tokens - 1) // block_size)`` (``workers.kv.manager``).

Snapshot: the body is an ``events/encode.py`` batch (msgpack, vLLM wire shape, decodable by ``events/decode.py``)
holding ``AllBlocksCleared`` then ``BlockStored`` runs for the GPU tier, the CPU tier, then the shared pool (every
tier the worker has), parents first: lower-tier blocks also on GPU token-less, the others with parent and tokens
(``KVCacheManager.snapshot_events``). Headers:
``x-kvgate-last-seq`` is the seq of the last batch published on the live stream *before* the snapshot was taken
(-1: none yet), ``x-kvgate-start-id`` the worker's start id. A subscriber splices: apply the snapshot, then apply
live batches with ``seq > last_seq`` (drop those ``<= last_seq``; replay ``last_seq + 1 ..`` if it missed any).

Errors are OpenAI JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input, 404 for an
unknown model. A client that disconnects cancels its handler (``handler_cancellation``) and the request's
blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import prometheus_client
from aiohttp import web

from common.errors import InvalidRequestError
from common.pd_protocol import BootstrapRequest
from common.process_stats import memory_report, register_process_collectors
from common.tokenization import (
    ByteTokenizer,
    ChatTemplate,
    Tokenizer,
    check_template,
    encode_chat,
    encode_prompt,
    load_tokenizer,
    normalize_messages,
)
from events.encode import BatchEncoder
from events.publisher import KVEventPublisher, PublisherConfig
from workers.config import WorkerConfig
from workers.core import EngineCore, RequestStream
from workers.engines.base import Engine, SamplingParams
from workers.engines.sim import SimEngine
from workers.errors import ConfigError, ContextLengthError
from workers.faults import Faults, fail_after_headers
from workers.handoff import DecodeHandoff, Leg, PrefillHandoff, PullRequest, TransferError, classify_leg
from workers.kv.manager import KVCacheManager
from workers.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    IncrementalDetokenizer,
    SamplingFields,
    TokenizeRequest,
    decode_request,
    error_body,
    stop_strings,
    validate_sampling,
)
from workers.scheduler import Request, Scheduler

logger = logging.getLogger(__name__)

WORKER_ID_HEADER = "x-worker-id"
"""Response header naming the worker that streamed the answer (a router in front relays it; the side-by-side
benchmark reads it to count each peer router's load per worker)."""
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


# helpers ---------------------------------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _error(
    worker: Worker, status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    worker.metrics.bad_requests.labels(worker.config.worker_id).inc()
    err_type = "invalid_request_error" if status == 400 else "not_found_error" if status == 404 else "error"
    return _json(error_body(message, err_type, param, code), status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn ``InvalidRequestError`` into OpenAI error JSON (400)."""
    worker = request.app[WORKER_KEY]
    try:
        return await handler(request)
    except InvalidRequestError as exc:
        return _error(worker, 400, exc.message, exc.param, exc.code)


def _check_model(worker: Worker, model: str | None) -> web.Response | None:
    if model is not None and model != worker.config.model:
        return _error(worker, 404, f"The model `{model}` does not exist.", "model", "model_not_found")
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


def _local_address(http_request: web.Request) -> tuple[str, int]:
    """The host and port this request reached the worker on."""
    sockname = http_request.transport.get_extra_info("sockname") if http_request.transport else None
    if sockname:
        return str(sockname[0]), int(sockname[1])
    return http_request.url.host or "127.0.0.1", http_request.url.port or 80


def _park(worker: Worker, http_request: web.Request, req: Request, room: int | None) -> dict[str, Any] | None:
    """Register a parked prefill leg with the handoff; its ``kv_transfer_params`` (``None``: not parked)."""
    if req.request_id not in worker.core.scheduler.parked:
        if room is not None:
            worker.prefill_handoff.fail_room(room, f"finished with {req.finish_reason}")
        return None
    host, port = _local_address(http_request)
    return worker.prefill_handoff.park(req, room, host, port)


async def _receive(worker: Worker, req: Request, body: SamplingFields, leg: Leg) -> RequestStream | web.Response:
    """The decode leg's handoff: reserve the blocks, pull the missing ones, register them (module docstring).

    Returns:
        The request's stream, ready to run, or the error response (503 refused, 502 pull failed).
    """
    core = worker.core
    stream = core.add_receiving(req)
    if stream is None:
        worker.decode_handoff.num_refused += 1
        sched = core.scheduler
        msg = (
            f"decode worker {worker.config.worker_id} cannot reserve KV blocks for a {req.num_prompt_tokens}-token "
            f"prompt now ({core.kv.gpu.num_free_blocks} free blocks, {sched.num_running} of "
            f"{sched.config.max_num_seqs} sequences running)"
        )
        resp = _error(worker, 503, msg, None, "kv_transfer_refused")
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
        return _error(worker, exc.status, exc.message, "kv_transfer_params", exc.code)
    except BaseException:
        core.finish_request(req.request_id, "abort")
        raise
    if not core.finish_receiving(req.request_id):
        return _error(worker, 502, "the request was aborted while its KV arrived", None, "kv_transfer_failed")
    return stream


def _usage(req: Request) -> dict[str, Any]:
    completion = req.num_output_tokens
    return {
        "prompt_tokens": req.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": req.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0},
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
        received = await _receive(worker, req, body, leg)
        if isinstance(received, web.Response):
            return received
        stream = received
    else:
        stream = core.add_request(req)
    detok = IncrementalDetokenizer(worker.tokenizer, stop_strings(body.stop))
    created = int(time.time())
    model = worker.config.model
    rid = req.request_id
    finished = False
    room = body.bootstrap_room if leg is Leg.SGLANG_PREFILL else None
    try:
        if body.stream:
            response = await _stream_response(worker, http_request, stream, detok, body, is_chat, created)
            if leg.is_prefill:
                _park(worker, http_request, req, room)
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
            "usage": _usage(req),
        }
        if leg.is_prefill:
            answer["kv_transfer_params"] = _park(worker, http_request, req, room)
        return _json(answer)
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
) -> web.StreamResponse:
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
            if text and not done:
                await resp.write(chunk(text, None))
            if done:
                if text:
                    await resp.write(chunk(text, None))
                await resp.write(chunk(None if is_chat else "", out.finish_reason))
                _record(worker, req, out.finish_reason or "stop")
                break
        if include_usage:
            await resp.write(b"data: " + enc({**base, "choices": [], "usage": _usage(req)}) + b"\n\n")
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
    return _json({"object": "list", "data": [entry]})


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
    return _json({"tokens": ids, "count": len(ids), "max_model_len": worker.config.scheduler.max_model_len})


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
    return _json(load_info(request.app[WORKER_KEY]))


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
    """``POST /reset_prefix_cache``: 200 when cleared, 409 while requests hold blocks."""
    worker = request.app[WORKER_KEY]
    if not worker.core.kv.reset_prefix_cache():
        return _json(error_body("requests are using KV blocks; retry when idle", "conflict", None, None), 409)
    worker.core.flush_events()
    return _json({"status": "ok"})


async def kv_pull(request: web.Request) -> web.Response:
    """``POST /kv/pull`` (``workers.handoff``)."""
    worker = request.app[WORKER_KEY]
    pull = decode_request(await request.read(), PullRequest)
    try:
        desc = await worker.prefill_handoff.begin_pull(pull)
    except TransferError as exc:
        return _json(error_body(exc.message, "kv_transfer_error", None, exc.code), exc.status)
    return _json(desc)


async def kv_pull_done(request: web.Request) -> web.Response:
    """``POST /kv/pull/done`` (``workers.handoff``)."""
    worker = request.app[WORKER_KEY]
    pull = decode_request(await request.read(), PullRequest)
    return _json({"released": worker.prefill_handoff.end_pull(pull)})


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
    return web.Response(
        body=prometheus_client.generate_latest(m.registry),
        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )


async def debug_memory(request: web.Request) -> web.Response:
    """``GET /debug/memory?limit=N``: the top ``N`` (25) allocation sites (``common.process_stats``)."""
    try:
        limit = int(request.query.get("limit", "25"))
    except ValueError:
        limit = 25
    return _json(memory_report(limit))


async def get_faults(request: web.Request) -> web.Response:
    """``GET /debug/faults``: the faults in force."""
    return _json(msgspec.to_builtins(request.app[WORKER_KEY].faults))


async def set_faults(request: web.Request) -> web.Response:
    """``POST /debug/faults``: replace the faults in force (``workers.faults.Faults``); 400 for a bad body."""
    worker = request.app[WORKER_KEY]
    try:
        faults = msgspec.json.decode(await request.read() or b"{}", type=Faults)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        return _error(worker, 400, f"bad faults: {exc}")
    worker.faults = faults
    publisher = worker.core.publisher
    if publisher is not None:
        publisher.set_faults(drop_sends=faults.drop_events, refuse_replay=faults.refuse_replay)
    logger.info("fault injection: %s", faults)
    return _json(msgspec.to_builtins(faults))


LOOP_KEY = web.AppKey("engine_loop", asyncio.Task[None])


async def _engine_loop_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[WORKER_KEY].core.run(), name="engine-loop")
    app[LOOP_KEY] = task
    yield
    worker = app[WORKER_KEY]
    worker.prefill_handoff.release_all()
    await worker.decode_handoff.close()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def build_app(worker: Worker) -> web.Application:
    """The aiohttp app of ``worker``; the engine loop starts and stops with the app."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[WORKER_KEY] = worker
    app.cleanup_ctx.append(_engine_loop_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/load", load)
    app.router.add_get("/kv/snapshot", snapshot)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/debug/memory", debug_memory)
    if worker.config.enable_fault_injection:
        app.router.add_get("/debug/faults", get_faults)
        app.router.add_post("/debug/faults", set_faults)
    app.router.add_post("/kv/pull", kv_pull)
    app.router.add_post("/kv/pull/done", kv_pull_done)
    return app


def make_publisher(config: WorkerConfig) -> KVEventPublisher | None:
    """The KV event publisher of ``config``, or ``None`` without an endpoint."""
    if config.kv_events_endpoint is None:
        return None
    return KVEventPublisher(
        PublisherConfig(
            endpoint=config.kv_events_endpoint, replay_endpoint=config.replay_endpoint, topic=config.kv_events_topic
        )
    )
