"""Disaggregated requests: one prefill leg, one decode leg, one decision, every reservation released once.

A model with a ``pd`` section (``router.config.PDConfig``) and workers of both roles is served disaggregated. The
path of one request (``PDLifecycle.run``), after the same parse, tokenization and admission slot as any request::

    route        the one index match of the prompt; the prefill candidates' and decode candidates' states
                 (``Router.states``); ``policies.pd.PDPolicy`` picks the pair (decode by fit, transfer and decode
                 load; prefill by cache-aware TTFT plus the transfer; a session's prefill leg goes to its owner in
                 the session store, its decode leg to the decode worker of its last turn, ``decode_owners``, while
                 that one fits). No decode worker fits: the request waits
                 for one (``wait_for_capacity``: woken by every release and every load poll, bounded queue,
                 ``queue_timeout_s``), then 429 with ``Retry-After``; one that no decode worker could hold even
                 empty (``PDPolicy.never_fits``) is a 400 ``context_length_exceeded`` at once.
    reserve      ``DecodeLedger.reserve`` on the decode worker before either leg is sent.
    prefill leg  vLLM: ``common.pd_protocol.prefill_leg_body`` sent to the prefill worker, its non-streamed answer
                 read whole (never relayed to the client); a connection error or a 5xx retries the next prefill
                 worker of the ranking, and so do ``kv_transfer_params`` no decode worker can use
                 (``unusable_prefill_params``); a 4xx is the request's fault and reaches the client with the
                 worker's status and error fields (``UpstreamRefusedError``). The answer's ``usage`` is the honesty
                 check of the prefill leg (predicted cached tokens from the prefill workers' index entries); its
                 ``kv_transfer_params`` go into the decode leg (``decode_leg_body``). SGLang: ``bootstrap_body``
                 with a fresh room, sent to the prefill worker and to the decode worker at the same time. Either
                 way the client's own ``kv_transfer_params`` and bootstrap fields reach no worker.
    decode leg   ``router.proxy.Proxy.forward`` with a plan of the decode workers (the chosen one first, then the
                 fitting rest of the ranking): relayed to the client byte for byte; a refusing decode worker (503
                 ``kv_transfer_refused``), a failed pull (502/504) or a dead worker retries the next decode worker
                 before any byte reached the client, the reservation moving with it (``pre_request``); vLLM: after
                 one that may have pulled the KV, with a fresh prefill leg first (``router.pd_retry``).
    finish       the reservation released, the prefill leg's pending index entries settled, the capacity waiters
                 woken, the decision recorded with both legs (``/admin/decisions``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from common.pd_protocol import (
    BootstrapFields,
    bootstrap_body,
    decode_leg_body,
    new_bootstrap_room,
    prefill_leg_body,
    remote_prefill_cached_tokens,
)
from policies.base import RequestView, Snapshot
from policies.cache_aware import CacheAwarePolicy
from policies.config import CacheAwareConfig, SessionStickyConfig
from policies.cost_model import TTFTCostModel
from policies.pd import DecodeCandidate, PDPairDecision, PDPolicy
from router.admission import Admission
from router.config import ModelConfig
from router.decisions import PDRecord, outcome_name
from router.errors import (
    GatewayError,
    NoWorkerError,
    OverloadedError,
    TransportError,
    TransportTimeoutError,
    UpstreamError,
    UpstreamTimeoutError,
)
from router.fleet import WorkerRuntime
from router.lease import WorkerLease
from router.metrics import GatewayMetrics
from router.mismatch import MismatchCounter
from router.pd_candidates import decode_candidates, ranking, split_roles
from router.pd_errors import prefill_refusal, too_large_error
from router.pd_ledger import DecodeLedger
from router.pd_retry import DecodeRetry, answer_params, unusable_answer
from router.proxy import REQUEST_ID_HEADER, ClientHeaders, Proxy, ProxyOutcome, RetryBody
from router.request_view import ParsedRequest, PromptView
from router.routing import IndexTicket, RoutePlan, Router
from router.sse import SSE_TAIL_BYTES, usage_from_body, usage_from_sse_tail
from router.transport import Transport, UpstreamRequest

logger = logging.getLogger(__name__)

MAX_DECODE_OWNERS = 65536
"""Sessions whose decode worker the gateway remembers (``PDLifecycle.decode_owners``)."""
RECHECK_S = 0.25
"""A request waiting for decode capacity re-checks at least this often (load polls change free blocks)."""


class _DecodeHooks:
    """The decode leg's attempt hooks (``router.proxy.AttemptHooks``): the reservation follows the attempt."""

    def __init__(self, flight: PDFlight) -> None:
        self._flight = flight
        self.lease: WorkerLease | None = None
        self.status: int | None = None
        flight.decode_hooks = self

    def pre_request(self, worker: WorkerRuntime, num_uncached_tokens: int) -> WorkerLease:
        f = self._flight
        r = f.lc.ledger.get(f.request_id)
        if r is not None and r.worker_id != worker.worker_id:
            f.lc.ledger.move(f.request_id, worker.worker_id, f.num_reserved_blocks_on(worker), r.num_transfer_bytes)
        lease = WorkerLease.acquire(worker, f.lc.metrics.worker(worker.worker_id), f.num_prompt_tokens, 0,
                                    f.lc.clock())
        self.lease = lease
        return lease

    def response_received(self, lease: WorkerLease, status: int) -> None:
        self.status = status
        self._flight.lc.ledger.transfer_landed(self._flight.request_id)

    def on_first_token(self, lease: WorkerLease, ttft_s: float) -> None:
        self._flight.lc.ledger.transfer_landed(self._flight.request_id)


class PDLifecycle:
    """What every disaggregated flight uses (one per gateway)."""

    def __init__(
        self,
        router: Router,
        proxy: Proxy,
        transport: Transport,
        metrics: GatewayMetrics,
        admission: Admission,
        *,
        ledger: DecodeLedger | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.router = router
        self.proxy = proxy
        self.transport = transport
        self.metrics = metrics
        self.admission = admission
        self.mismatches = MismatchCounter(router, metrics)
        self.ledger = ledger if ledger is not None else DecodeLedger()
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.num_waiting = 0
        self.num_rejected = 0
        self._capacity = asyncio.Event()
        self._policies: dict[str, tuple[CacheAwareConfig, PDPolicy]] = {}
        self.decode_owners: OrderedDict[str, str] = OrderedDict()
        """Session key -> the decode worker that served its last turn (it registered the turn's KV as cached, so
        the next turn's decode leg finds the prefix local), least recent first, at most ``MAX_DECODE_OWNERS``;
        this gateway's own (the prefill leg's owner is the session store's, shared by replicas)."""

    def remember_decode_owner(self, session_key: str, worker_id: str) -> None:
        """``worker_id`` served the session's last decode leg."""
        self.decode_owners[session_key] = worker_id
        self.decode_owners.move_to_end(session_key)
        while len(self.decode_owners) > MAX_DECODE_OWNERS:
            self.decode_owners.popitem(last=False)

    def capacity_changed(self) -> None:
        """Wake the requests waiting for decode capacity (a release, a load poll, a worker added)."""
        self._capacity.set()

    def start(self, request_id: str) -> PDFlight:
        """The flight of one disaggregated request that holds an admission slot (its end gives the slot back)."""
        return PDFlight(self, request_id)

    def policy(self, model: ModelConfig) -> PDPolicy:
        """The pair policy of ``model``: cache-aware over the prefill workers with the live policy's cost model
        (its ``cache_aware`` config, or the one ``session_sticky`` wraps; the defaults otherwise)."""
        config = self.router.holder.config
        inner = config.inner if isinstance(config, SessionStickyConfig) else config
        ca = inner if isinstance(inner, CacheAwareConfig) else CacheAwareConfig()
        cached = self._policies.get(model.name)
        if cached is not None and cached[0] is ca:
            return cached[1]
        assert model.pd is not None
        policy = PDPolicy(CacheAwarePolicy(ca), TTFTCostModel(ca), model.pd.transfer())
        self._policies[model.name] = (ca, policy)
        return policy


class PDFlight:
    """One disaggregated request (module docstring)."""

    def __init__(self, lifecycle: PDLifecycle, request_id: str) -> None:
        self.lc = lifecycle
        self.request_id = request_id
        self.num_prompt_tokens = 0
        self.pair: PDPairDecision | None = None
        self._view: RequestView | None = None
        self._decodes: dict[str, DecodeCandidate] = {}
        self._decode_ticket: IndexTicket | None = None
        self._ticket: IndexTicket | None = None
        self.decode_hooks: _DecodeHooks | None = None

    def num_reserved_blocks_on(self, worker: WorkerRuntime) -> int:
        """Blocks the request holds on ``worker`` (``PDPolicy.needed_blocks``)."""
        cand = self._decodes.get(worker.worker_id)
        pair = self.pair
        if cand is None or self._view is None or pair is None:
            return pair.num_reserved_blocks if pair is not None else 0
        return self._policy.needed_blocks(self._view, cand)

    _policy: PDPolicy

    async def run(
        self,
        request: web.Request,
        body: bytes,
        parsed: ParsedRequest,
        model: ModelConfig,
        view: PromptView,
        client_headers: ClientHeaders,
        *,
        received_at: float,
    ) -> ProxyOutcome:
        """Route both legs, forward them, finish (module docstring); the outcome relayed to the client.

        Raises:
            asyncio.CancelledError: the client went away (everything is released first).
        """
        lc = self.lc
        self._policy = lc.policy(model)
        self.num_prompt_tokens = view.num_tokens
        pd = model.pd
        assert pd is not None
        record: dict[str, Any] = {}
        outcome: ProxyOutcome | None = None
        ticket: IndexTicket | None = None
        try:
            try:
                pair, prefill_ws, decode_ws, ticket, record = await self._route(parsed, model, view, client_headers)
                self._ticket = ticket
            except GatewayError as exc:
                outcome = ProxyOutcome(None, None, None, exc)
                return outcome
            self.pair = pair
            try:
                client_body = msgspec.json.decode(body)
            except msgspec.DecodeError as exc:  # parse_request accepted it: cannot happen, but never crash
                outcome = ProxyOutcome(None, None, None, GatewayError(f"body is not JSON: {exc}"))
                return outcome
            if pd.protocol == "vllm":
                outcome = await self._run_vllm(
                    request, client_body, parsed, prefill_ws, decode_ws, client_headers, record, received_at
                )
            else:
                outcome = await self._run_sglang(
                    request, client_body, parsed, prefill_ws, decode_ws, client_headers, record, received_at
                )
            return outcome
        except asyncio.CancelledError:  # the client left: an answer that began was served by its decode worker
            lease = self.decode_hooks.lease if self.decode_hooks is not None else None
            if lease is not None and lease.has_first_byte:
                outcome = ProxyOutcome(None, lease.worker, self.decode_hooks.status if self.decode_hooks else None,
                                       has_client_bytes=True, is_client_gone=True)
            raise
        finally:
            lc.ledger.release(self.request_id)
            lc.capacity_changed()
            lc.admission.release()
            if ticket is not None and self.pair is not None:
                prefill_id = self.pair.prefill.worker_id
                served = record.get("prefill_served_by_worker")
                chosen = lc.router.fleet.workers.get(prefill_id) if prefill_id else None
                ok = outcome is not None and outcome.is_ok
                if chosen is not None:
                    ticket.settle(chosen, served, ok, lc.clock(), keep_window=bool(record.pop("prefill_confirming", 0)))
                decode_chosen = lc.router.fleet.workers.get(self.pair.decode.worker_id or "")  # "": no worker
                if self._decode_ticket is not None and decode_chosen is not None:
                    decode_served = outcome.served_by if outcome is not None else None
                    self._decode_ticket.settle(decode_chosen, decode_served, ok, lc.clock())
                key = record.get("session_key")
                if ok and key is not None and outcome is not None and outcome.served_by is not None:
                    lc.remember_decode_owner(key, outcome.served_by.worker_id)
            ticket = self._ticket = self._decode_ticket = None  # the flight and its hooks are a cycle: go now
            if record:
                record.pop("prefill_served_by_worker", None)
                lc.router.recent.append(
                    PDRecord(
                        **record,
                        decode_served_by=outcome.served_by.worker_id if outcome and outcome.served_by else None,
                        outcome=outcome_name(outcome),
                    )
                )

    async def _route(
        self, parsed: ParsedRequest, model: ModelConfig, view: PromptView, client_headers: ClientHeaders
    ) -> tuple[PDPairDecision, list[WorkerRuntime], list[WorkerRuntime], IndexTicket, dict[str, Any]]:
        lc = self.lc
        router = lc.router
        pd = model.pd
        assert pd is not None
        workers = router.fleet.candidates(model.name)
        prefill_ws, decode_ws = split_roles(workers)
        if not prefill_ws or not decode_ws:
            raise NoWorkerError(
                f"model {model.name!r} needs prefill and decode workers ({len(prefill_ws)} and {len(decode_ws)})",
                reason="no_pd_pair",
            )
        ticket = router.ticket(model, view)
        match = ticket.match()
        session_key = router.session_key(client_headers.routing, parsed, view)
        req = RequestView(
            self.request_id,
            parsed.model,
            view.num_tokens,
            parsed.max_tokens or model.default_max_tokens,
            view.block_size,
            session_key,
        )
        self._view = req
        loop = asyncio.get_running_loop()
        deadline = loop.time() + pd.queue_timeout_s
        waited = False
        try:
            while True:
                t0 = time.perf_counter()
                now_s = lc.clock()
                states, predicted = router.states(prefill_ws, view, now_s, 0, match)
                decodes = decode_candidates(router, decode_ws, view, match, now_s, lc.ledger)
                self._decodes = {d.worker_id: d for d in decodes}
                snapshot = Snapshot(states, None, now_s)
                prefill_decision = None
                sticky = router.holder.sticky
                if sticky is not None and session_key is not None:  # the session's prefix lives on its prefill worker
                    prefill_decision = await router.ownership.claim(sticky, session_key, req, snapshot)
                owner = lc.decode_owners.get(session_key) if session_key is not None else None
                pair = self._policy.select(req, snapshot, decodes, prefill_decision=prefill_decision,
                                           decode_session_owner=owner)
                if pair.decode.worker_id is not None or pair.decode.reason != "no_decode_capacity":
                    break
                too_large = self._policy.never_fits(req, decodes)
                if too_large is not None:  # waiting cannot help: a 400, as an engine refuses a too long context
                    raise too_large_error(parsed, req, *too_large)
                remaining = deadline - loop.time()
                if not waited:
                    if lc.num_waiting >= pd.max_waiting:
                        lc.num_rejected += 1
                        raise OverloadedError(
                            "every decode worker is full and the wait queue is full", retry_after_s=pd.retry_after_s
                        )
                    lc.num_waiting += 1
                    waited = True
                if remaining <= 0:
                    lc.num_rejected += 1
                    raise OverloadedError(
                        f"no decode worker could take the request's KV within {pd.queue_timeout_s} s",
                        retry_after_s=pd.retry_after_s,
                    )
                lc._capacity.clear()
                try:
                    async with asyncio.timeout(min(remaining, RECHECK_S)):
                        await lc._capacity.wait()
                except TimeoutError:
                    pass
        finally:  # a timeout, a refusal or the client leaving while it waits all give the wait slot back
            if waited:
                lc.num_waiting -= 1
        decision_s = time.perf_counter() - t0
        if pair.prefill.worker_id is None or pair.decode.worker_id is None:
            reason = pair.prefill.reason if pair.prefill.worker_id is None else pair.decode.reason
            raise NoWorkerError(f"no prefill/decode pair for model {model.name!r}: {reason}", reason=reason)
        lc.ledger.reserve(self.request_id, pair.decode.worker_id, pair.num_reserved_blocks, pair.num_transfer_bytes)
        by_id = {w.worker_id: w for w in workers}
        ticket.insert_for(by_id[pair.prefill.worker_id], match, now_s)
        # pending entries on the decode worker too (it registers the blocks once landed), settled after the answer
        self._decode_ticket = router.ticket(model, view)
        self._decode_ticket.insert_for(by_id[pair.decode.worker_id], match, now_s)
        prefill_rank = [by_id[w] for w in ranking(pair.prefill) if w in by_id and w in predicted]
        decode_rank = [by_id[w] for w in ranking(pair.decode) if w in by_id and pair.fits.get(w)]
        record: dict[str, Any] = {
            "request_id": self.request_id,
            "model": model.name,
            "protocol": pd.protocol,
            "prefill_worker_id": pair.prefill.worker_id,
            "decode_worker_id": pair.decode.worker_id,
            "prefill_reason": pair.prefill.reason,
            "decode_reason": pair.decode.reason,
            "prefill_scores": dict(pair.prefill.scores),
            "decode_scores": dict(pair.decode.scores),
            "decode_fits": dict(pair.fits),
            "predicted_cached_tokens": predicted,
            "num_reserved_blocks": pair.num_reserved_blocks,
            "num_transfer_bytes": pair.num_transfer_bytes,
            "transfer_s": pair.transfer_s,
            "num_prompt_tokens": view.num_tokens,
            "session_key": session_key,
            "decision_s": decision_s,
            "at_s": now_s,
        }
        return pair, prefill_rank, decode_rank, ticket, record

    def _headers(self, client_headers: ClientHeaders) -> list[tuple[str, str]]:
        fwd = [(k, v) for k, v in client_headers.forward if k.lower() not in ("content-length",)]
        if client_headers.request_id is None:
            fwd.append((REQUEST_ID_HEADER, self.request_id))
        return fwd

    async def _prefill(
        self,
        request: web.Request,
        prefill_ws: list[WorkerRuntime],
        body: dict[str, Any],
        client_headers: ClientHeaders,
        record: dict[str, Any],
        *,
        retry: bool,
        check: Callable[[dict[str, Any]], str | None] | None = None,
        is_again: bool = False,
    ) -> tuple[WorkerRuntime, dict[str, Any]] | GatewayError:
        """Send the prefill leg along the ranking (retrying before its answer); the worker and its JSON answer.

        ``check``: why a 200 answer (its JSON object, ``{}`` when it is none) is unusable, or ``None``; an unusable
        one is the worker's failure, like a 5xx. ``is_again``: the leg is sent a second time for a decode retry
        (``_run_vllm``): its cached tokens come from the first leg, so it is not the honesty check and the record
        keeps the first leg's report."""
        lc = self.lc
        data = msgspec.json.encode(body)
        predicted: dict[str, int] = record["predicted_cached_tokens"]
        headers = self._headers(client_headers)
        last: GatewayError = UpstreamError("no prefill worker reachable")
        for worker in prefill_ws if retry else prefill_ws[:1]:
            if not worker.breaker.allows(lc.clock()):
                continue
            uncached = max(0, self.num_prompt_tokens - predicted.get(worker.worker_id, 0))
            lease = WorkerLease.acquire(worker, lc.metrics.worker(worker.worker_id), self.num_prompt_tokens, uncached,
                                        lc.clock())
            resp = None
            try:
                try:
                    resp = await lc.transport.send(
                        UpstreamRequest(
                            worker.worker_id,
                            worker.config.url,
                            "POST",
                            request.raw_path,
                            headers,
                            data,
                            client_headers.skip_auto_headers,
                        )
                    )
                    answer = await resp.read()
                except TransportError as exc:
                    lease.record_failure(lc.clock())
                    last = exc
                    logger.warning(
                        "request %s: prefill worker %s failed: %s", self.request_id, worker.worker_id, exc.message
                    )
                    continue
                lease.on_first_byte(lc.clock())
                lease.on_last_byte()
                if resp.status >= 500:
                    lease.record_failure(lc.clock())
                    last = UpstreamError(f"prefill worker answered {resp.status}", worker_id=worker.worker_id)
                    continue
                is_sse = answer.startswith(b"data:")  # an SGLang prefill leg of a streamed request streams too
                try:
                    decoded = {} if is_sse else msgspec.json.decode(answer)
                except msgspec.DecodeError:
                    decoded = {}
                if not isinstance(decoded, dict):
                    decoded = {}
                unusable = check(decoded) if check is not None and resp.status == 200 else None
                if unusable is not None:
                    lease.record_failure(lc.clock())
                    last = UpstreamError(
                        f"prefill worker {worker.worker_id} answered kv_transfer_params no decode worker can use: "
                        f"{unusable}",
                        worker_id=worker.worker_id,
                    )
                    logger.warning("request %s: %s", self.request_id, last.message)
                    continue
                lease.record_success()
                if resp.status != 200:
                    return prefill_refusal(worker.worker_id, resp.status, answer)
                if not is_again:
                    usage = usage_from_sse_tail(answer[-SSE_TAIL_BYTES:]) if is_sse else usage_from_body(answer)
                    guess = predicted.get(worker.worker_id, 0)
                    reported = lc.proxy.check_honesty(worker, lease.metrics, guess, usage)
                    if reported is not None and reported != guess and (ticket := self._ticket) is not None:  # unsettled
                        record["prefill_confirming"] = lc.mismatches.count(worker.worker_id, ticket, guess, reported)
                    record["reported_cached_tokens"] = reported
                record["prefill_served_by"] = worker.worker_id
                record["prefill_served_by_worker"] = worker
                return worker, decoded
            finally:
                if resp is not None:
                    resp.release()
                lease.release()
        worker_id = getattr(last, "worker_id", None)
        error: GatewayError = (
            UpstreamTimeoutError(f"no prefill worker answered in time: {last.message}", worker_id=worker_id)
            if isinstance(last, TransportTimeoutError)
            else UpstreamError(f"every prefill attempt failed: {last.message}", worker_id=worker_id)
        )
        error.__cause__ = last
        return error

    def _decode_plan(self, decode_ws: list[WorkerRuntime], reported_by_prefill: int | None = None) -> RoutePlan:
        """The decode leg's plan; its honesty check expects the decode worker's own index depth of the prompt, or
        ``reported_by_prefill`` for every decode worker where the handshake carries the prefill side's hits (vLLM
        0.32 ``remote_prefill_cached_tokens``, which its decode worker reports as ``cached_tokens``)."""
        pair = self.pair
        assert pair is not None
        by_id = {w.worker_id: w for w in decode_ws}
        cached = {w: d.num_gpu_cached_tokens for w, d in self._decodes.items()}
        if reported_by_prefill is not None:
            cached = dict.fromkeys(by_id, reported_by_prefill)
        return RoutePlan(
            pair.decode,
            decode_ws[0],
            {w.worker_id: cached.get(w.worker_id, 0) for w in decode_ws},
            self.num_prompt_tokens,
            None,
            workers_by_id=by_id,
        )

    async def _forward_decode(
        self,
        request: web.Request,
        body: bytes,
        plan: RoutePlan,
        parsed: ParsedRequest,
        received_at: float,
        client_headers: ClientHeaders,
        retry_body: RetryBody | None = None,
    ) -> ProxyOutcome:
        """The decode leg through the proxy (it answers the client), with the decode hooks."""
        return await self.lc.proxy.forward(
            request,
            body,
            plan,
            _DecodeHooks(self),
            is_stream=parsed.is_stream,
            request_id=self.request_id,
            policy_name="pd",
            received_at=received_at,
            client_headers=client_headers,
            retry_body=retry_body,
        )

    async def _run_vllm(
        self,
        request: web.Request,
        client_body: dict[str, Any],
        parsed: ParsedRequest,
        prefill_ws: list[WorkerRuntime],
        decode_ws: list[WorkerRuntime],
        client_headers: ClientHeaders,
        record: dict[str, Any],
        received_at: float,
    ) -> ProxyOutcome:
        leg, check = prefill_leg_body(client_body), unusable_answer
        got = await self._prefill(request, prefill_ws, leg, client_headers, record, retry=True, check=check)
        if isinstance(got, GatewayError):
            return ProxyOutcome(None, None, None, got)
        params = answer_params(got[1])
        body = msgspec.json.encode(decode_leg_body(client_body, params))
        plan = self._decode_plan(decode_ws, remote_prefill_cached_tokens(params))

        async def fresh_prefill() -> dict[str, Any] | None | GatewayError:
            again = await self._prefill(request, prefill_ws, leg, client_headers, record, retry=True, check=check,
                                        is_again=True)
            return again if isinstance(again, GatewayError) else answer_params(again[1])

        retry = DecodeRetry(self.request_id, body, plan, fresh_prefill,
                            lambda fresh: msgspec.json.encode(decode_leg_body(client_body, fresh)))
        return await self._forward_decode(request, body, plan, parsed, received_at, client_headers, retry)

    async def _run_sglang(
        self,
        request: web.Request,
        client_body: dict[str, Any],
        parsed: ParsedRequest,
        prefill_ws: list[WorkerRuntime],
        decode_ws: list[WorkerRuntime],
        client_headers: ClientHeaders,
        record: dict[str, Any],
        received_at: float,
    ) -> ProxyOutcome:
        prefill = prefill_ws[0]
        url = urlsplit(prefill.config.url)
        port = prefill.config.bootstrap_port if prefill.config.bootstrap_port is not None else url.port
        fields = BootstrapFields(url.hostname or "127.0.0.1", port, new_bootstrap_room(self.lc.rng))
        leg = bootstrap_body(client_body, fields)
        task = asyncio.create_task(self._prefill(request, [prefill], leg, client_headers, record, retry=False))
        try:
            outcome = await self._forward_decode(
                request, msgspec.json.encode(leg), self._decode_plan(decode_ws), parsed, received_at, client_headers
            )
        except BaseException:
            task.cancel()
            raise
        got = await task
        if isinstance(got, GatewayError) and outcome.response is None:
            return ProxyOutcome(None, None, None, got)
        return outcome
