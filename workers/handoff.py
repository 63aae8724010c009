"""The prefill/decode handoff of the reference worker: parked KV on the prefill side, pulls on the decode side.

The client-facing handshakes are the engines' own (``common.pd_protocol``): vLLM's ``kv_transfer_params`` and
SGLang's bootstrap fields. Which leg a request is follows from the worker's role and those fields
(``classify_leg``). Between the two workers the KV moves by a **pull** the decode side makes to the prefill side's
HTTP server, in the spirit of NIXL (a one-sided read, then a notification that frees the blocks)::

    POST /kv/pull       {"remote_request_id": str | null, "bootstrap_room": int | null,
                         "first_block_index": int, "engine_id": str}
        200 -> {"block_ids": [...], "block_size": int, "num_tokens": int, "kv_bytes": int}
               (the prefill worker's blocks from first_block_index on, which the decode side now reads)
        404 -> unknown request or room (never parked, already pulled, or expired); 409 -> a pull is in flight
        A room whose prefill has not finished yet (SGLang: both legs start together) is waited for, up to
        ``kv-transfer.pull-timeout-s``.
    POST /kv/pull/done  {"remote_request_id" | "bootstrap_room", "engine_id", "ok": bool}
        200 -> {"released": bool}: the transfer reader is gone; the blocks are freed once the lower-tier stores
               the request issued have landed too (``workers.scheduler``)

Prefill side (``PrefillHandoff``): a prefill leg that finishes by length is parked by the scheduler; ``park``
answers the ``kv_transfer_params`` vLLM's NIXL connector returns and arms the abort timer
(``abort-request-timeout-s``, vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``): nobody pulled by then, the blocks are
released. A pull in flight when the timer fires defers it once by ``pull-timeout-s``.

Decode side (``DecodeHandoff``): the request first reserves its blocks (``EngineCore.add_receiving``: the local
GPU prefix hit plus new blocks for the rest of the prompt; refused when they cannot be had), then pulls only the
blocks it does not hold. The pull occupies the worker's link, one transfer at a time (FIFO)::

    transfer_s = kv_transfer_latency_s + num_blocks * block_size * kv_bytes_per_token / kv_link_bytes_per_s

slept as ``transfer_s * time_scale`` wall seconds, then it notifies the prefill side, registers the blocks as
cached (``BlockStored``) and decodes. Any failure releases the reservation and raises ``TransferError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import aiohttp
import msgspec

from common.errors import InvalidRequestError
from common.pd_protocol import MAX_BOOTSTRAP_ROOM, BootstrapRequest, KVTransferParams
from workers.config import TimingProfile, WorkerConfig
from workers.core import EngineCore
from workers.errors import WorkerError
from workers.scheduler import Request

logger = logging.getLogger(__name__)


class Leg(StrEnum):
    """What a request is to this worker."""

    PLAIN = "plain"
    VLLM_PREFILL = "vllm_prefill"
    VLLM_DECODE = "vllm_decode"
    SGLANG_PREFILL = "sglang_prefill"
    SGLANG_DECODE = "sglang_decode"

    @property
    def is_prefill(self) -> bool:
        """Whether the request's KV is kept for a decode worker."""
        return self in (Leg.VLLM_PREFILL, Leg.SGLANG_PREFILL)

    @property
    def is_decode(self) -> bool:
        """Whether the request's prompt KV is pulled from a prefill worker."""
        return self in (Leg.VLLM_DECODE, Leg.SGLANG_DECODE)


class TransferError(WorkerError):
    """A pull failed (prefill worker unreachable, request unknown or expired, timeout).

    Attributes:
        status: HTTP status for the client of the decode leg.
        code: OpenAI-style error code.
    """

    def __init__(self, message: str, status: int = 502, code: str = "kv_transfer_failed") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class PullRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /kv/pull`` and ``POST /kv/pull/done`` (module docstring); ``bootstrap_room`` in the range a
    leg's body takes (``common.pd_protocol.MAX_BOOTSTRAP_ROOM``), so no pull waits for a room no leg can name."""

    engine_id: str
    remote_request_id: str | None = None
    bootstrap_room: Annotated[int, msgspec.Meta(ge=0, le=MAX_BOOTSTRAP_ROOM)] | None = None
    first_block_index: int = 0
    ok: bool = True


class TransferDescriptor(msgspec.Struct, frozen=True):
    """Answer of ``POST /kv/pull``: what the decode side reads.

    Attributes:
        block_ids: the prefill worker's block ids read, in prompt order.
        block_size: tokens per block.
        num_tokens: prompt tokens the parked request computed.
        kv_bytes: bytes read (``len(block_ids) * block_size * kv_bytes_per_token``).
    """

    block_ids: list[int]
    block_size: int
    num_tokens: int
    kv_bytes: int


def classify_leg(role: str, kv_transfer_params: dict[str, Any] | None, bootstrap: BootstrapRequest) -> Leg:
    """Which leg a request is, from the worker's role and the request's PD fields.

    Raises:
        InvalidRequestError: malformed ``kv_transfer_params``, a leg this role does not serve, incomplete remote
            prefill params, or bootstrap fields on a ``both`` worker (they name no leg).
    """
    if kv_transfer_params:
        try:
            params = msgspec.convert(kv_transfer_params, KVTransferParams)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"invalid kv_transfer_params: {exc}", param="kv_transfer_params") from exc
        if params.do_remote_decode:
            if role == "decode":
                raise InvalidRequestError(
                    "this worker has role 'decode': it does not serve prefill legs (do_remote_decode)",
                    param="kv_transfer_params",
                )
            return Leg.VLLM_PREFILL
        if params.do_remote_prefill:
            if role == "prefill":
                raise InvalidRequestError(
                    "this worker has role 'prefill': it does not pull remote KV (do_remote_prefill)",
                    param="kv_transfer_params",
                )
            try:
                params.block_ids_by_group()
            except ValueError as exc:
                raise InvalidRequestError(f"invalid kv_transfer_params: {exc}", param="kv_transfer_params") from exc
            if not params.is_complete_remote_prefill:
                raise InvalidRequestError(
                    "kv_transfer_params with do_remote_prefill need remote_block_ids, remote_engine_id, "
                    "remote_request_id, remote_host and remote_port",
                    param="kv_transfer_params",
                )
            return Leg.VLLM_DECODE
        return Leg.PLAIN
    if bootstrap.is_pd_leg:
        if role == "prefill":
            return Leg.SGLANG_PREFILL
        if role == "decode":
            if bootstrap.bootstrap_port is None:
                raise InvalidRequestError("bootstrap_port is required on a decode leg", param="bootstrap_port")
            return Leg.SGLANG_DECODE
        raise InvalidRequestError(
            "bootstrap fields need a worker started with --role prefill or --role decode", param="bootstrap_room"
        )
    return Leg.PLAIN


def transfer_s(profile: TimingProfile, block_size: int, num_blocks: int) -> float:
    """Simulated duration of one pull of ``num_blocks`` blocks (module docstring)."""
    num_bytes = num_blocks * block_size * profile.kv_bytes_per_token
    return profile.kv_transfer_latency_s + num_bytes / profile.kv_link_bytes_per_s


@dataclass
class _Parked:
    request: Request
    room: int | None
    timer: asyncio.TimerHandle | None = None
    pull_in_flight: bool = False
    deferred: bool = False


class PrefillHandoff:
    """Parked prefill KV and the pulls that read it (module docstring)."""

    def __init__(self, core: EngineCore, config: WorkerConfig) -> None:
        """Args:
        core: the worker's engine core.
        config: the worker config (``kv-transfer`` section, worker id, block size, timing).
        """
        self.core = core
        self.config = config.kv_transfer
        self.engine_id = config.kv_transfer.engine_id or config.worker_id
        self.advertise_host = config.kv_transfer.advertise_host
        self.block_size = config.kv_cache.block_size
        self.kv_bytes_per_token = config.timing.kv_bytes_per_token
        self._parked: dict[str, _Parked] = {}
        self._rooms: dict[int, str] = {}
        self._room_waiters: dict[int, asyncio.Future[str | None]] = {}
        self._room_failures: OrderedDict[int, str] = OrderedDict()
        self.num_parked = 0
        self.num_pulled = 0
        self.num_expired = 0

    @property
    def num_waiting_pulls(self) -> int:
        """Pulls waiting for a room whose prefill has not finished."""
        return len(self._room_waiters)

    def is_registered(self, request_id: str) -> bool:
        """Whether ``park`` registered the request (and it has not been released)."""
        return request_id in self._parked

    def park(self, request: Request, room: int | None, host: str, port: int) -> dict[str, Any]:
        """Register a prefill leg the scheduler parked and arm its abort timer.

        Args:
            request: finished by length with ``park_on_finish`` (its blocks are still referenced).
            room: its bootstrap room (SGLang flow), or ``None``.
            host: the address the prefill leg reached this worker on (``remote_host`` unless
                ``kv-transfer.advertise-host`` is set).
            port: its port (``remote_port``).

        Returns:
            The ``kv_transfer_params`` of the response, as vLLM 0.32's NIXL connector answers
            (``common.pd_protocol.KVTransferParams``: the block ids of the one KV cache group in a list of their
            own, the prompt tokens computed as ``remote_num_tokens``, ``transfer_mode`` pull, and the prompt tokens
            it found cached as ``remote_prefill_cached_tokens``, which the decode leg reports).
        """
        rid = request.request_id
        entry = _Parked(request, room)
        self._parked[rid] = entry
        self.num_parked += 1
        entry.timer = asyncio.get_running_loop().call_later(self.config.abort_request_timeout_s, self._expire, rid)
        if room is not None:
            self._rooms[room] = rid
            waiter = self._room_waiters.pop(room, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(rid)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(request.kv.block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.advertise_host or host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": request.num_cached_tokens or 0,
        }

    def fail_room(self, room: int, reason: str) -> None:
        """The prefill leg of ``room`` ended without parking (aborted, refused): a waiting pull fails now."""
        waiter = self._room_waiters.pop(room, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._room_failures[room] = reason  # for a pull that arrives later, bounded
        while len(self._room_failures) > self.config.max_pending_rooms:
            self._room_failures.popitem(last=False)

    def _release(self, rid: str, expired: bool) -> bool:
        entry = self._parked.pop(rid, None)
        if entry is None:
            return False
        if entry.timer is not None:
            entry.timer.cancel()
        if entry.room is not None:
            self._rooms.pop(entry.room, None)
        if expired:
            self.num_expired += 1
            logger.info("parked KV of %s expired unpulled; releasing %d blocks", rid, len(entry.request.kv.block_ids))
        self.core.release_transfer_reader(rid)
        return True

    def _expire(self, rid: str) -> None:
        entry = self._parked.get(rid)
        if entry is None:
            return
        if entry.pull_in_flight and not entry.deferred:
            entry.deferred = True
            entry.timer = asyncio.get_running_loop().call_later(self.config.pull_timeout_s, self._expire, rid)
            return
        self._release(rid, expired=True)

    def release_parked(self) -> int:
        """Drop every parked transfer (a reset between runs); how many were dropped."""
        return sum(self._release(rid, expired=False) for rid in list(self._parked))

    def release_all(self) -> None:
        """Drop every parked transfer and fail the rooms waited on (shutdown)."""
        self.release_parked()
        for room in list(self._room_waiters):
            self.fail_room(room, "worker shutting down")

    async def _resolve(self, pull: PullRequest) -> str:
        if pull.remote_request_id is not None:
            return pull.remote_request_id
        room = pull.bootstrap_room
        if room is None:
            raise TransferError("a pull names remote_request_id or bootstrap_room", 400, "invalid_request")
        rid = self._rooms.get(room)
        if rid is not None:
            return rid
        if room in self._room_failures:
            reason = self._room_failures.pop(room)
            raise TransferError(f"prefill of room {room} did not complete: {reason}", 404)
        waiter = self._room_waiters.get(room)
        if waiter is None:
            if len(self._room_waiters) >= self.config.max_pending_rooms:
                raise TransferError("too many pulls wait for unfinished prefills", 503, "kv_transfer_busy")
            waiter = self._room_waiters[room] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self.config.pull_timeout_s):  # never swallows a cancel (wait_for on 3.11)
                rid = await asyncio.shield(waiter)
        except TimeoutError:
            self._room_waiters.pop(room, None)
            raise TransferError(f"no prefill finished for room {room} within the pull timeout", 404) from None
        except asyncio.CancelledError:
            if self._room_waiters.get(room) is waiter:  # the decode side gave up
                del self._room_waiters[room]
            raise
        if rid is None:
            reason = self._room_failures.pop(room, "unknown")
            raise TransferError(f"prefill of room {room} did not complete: {reason}", 404)
        return rid

    async def begin_pull(self, pull: PullRequest) -> TransferDescriptor:
        """Serve ``POST /kv/pull``.

        Raises:
            TransferError: unknown request or room (404), a pull already in flight (409), a bad index (400).
        """
        rid = await self._resolve(pull)
        entry = self._parked.get(rid)
        if entry is None:
            raise TransferError(f"no parked KV for request {rid} (never parked, pulled, or expired)", 404)
        if entry.pull_in_flight:
            raise TransferError(f"a pull of {rid} is already in flight", 409, "kv_transfer_busy")
        blocks = entry.request.kv.block_ids
        if not 0 <= pull.first_block_index <= len(blocks):
            raise TransferError(f"first_block_index {pull.first_block_index} outside 0..{len(blocks)}", 400)
        entry.pull_in_flight = True
        read = list(blocks[pull.first_block_index :])
        return TransferDescriptor(
            block_ids=read,
            block_size=self.block_size,
            num_tokens=entry.request.num_prompt_tokens,
            kv_bytes=len(read) * self.block_size * self.kv_bytes_per_token,
        )

    def end_pull(self, pull: PullRequest) -> bool:
        """Serve ``POST /kv/pull/done``: the transfer reader is gone (pulled, or given up by the decode side).

        Returns:
            Whether a parked transfer was released.
        """
        rid = pull.remote_request_id
        if rid is None and pull.bootstrap_room is not None:
            rid = self._rooms.get(pull.bootstrap_room)
        if rid is None or rid not in self._parked:
            return False
        if pull.ok:
            self.num_pulled += 1
        return self._release(rid, expired=False)


class DecodeHandoff:
    """Pulls on the decode side over one FIFO link (module docstring)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.engine_id = config.kv_transfer.engine_id or config.worker_id
        self.profile = config.timing
        self.block_size = config.kv_cache.block_size
        self.time_scale = config.time_scale
        self.pull_timeout_s = config.kv_transfer.pull_timeout_s
        self._link_free_at = 0.0
        self._session: aiohttp.ClientSession | None = None
        self.num_pulls = 0
        self.num_pulled_blocks = 0
        self.num_failed = 0
        self.num_refused = 0

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.pull_timeout_s))
        return self._session

    async def _post(self, url: str, pull: PullRequest) -> tuple[int, bytes]:
        try:
            async with self._http().post(
                url, data=msgspec.json.encode(pull), headers={"Content-Type": "application/json"}
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError as exc:
            raise TransferError(f"pull from {url} timed out after {self.pull_timeout_s} s", 504) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise TransferError(f"pull from {url} failed: {type(exc).__name__}: {exc}", 502) from exc

    async def pull(
        self, base_url: str, pull: PullRequest, num_blocks_expected: int, num_tokens_expected: int
    ) -> TransferDescriptor:
        """Read the blocks from the prefill worker at ``base_url`` and notify it.

        Args:
            base_url: ``http://host:port`` of the prefill worker.
            pull: what to read (``first_block_index``: the blocks this worker already holds).
            num_blocks_expected: blocks this worker reserved for the pulled part of the prompt.
            num_tokens_expected: the prompt length here (the parked request's must be the same).

        Raises:
            TransferError: the prefill worker refused or failed, answered something that is not a
                ``TransferDescriptor``, or its parked request does not match (block count or prompt length).
        """
        try:
            status, body = await self._post(base_url + "/kv/pull", pull)
        except TransferError:
            self.num_failed += 1
            raise
        if status != 200:
            self.num_failed += 1
            raise TransferError(f"prefill worker {base_url} refused the pull ({status}): {body[:200]!r}", 502)
        try:
            desc = msgspec.json.decode(body, type=TransferDescriptor)
        except msgspec.DecodeError as exc:  # ValidationError too: a prefill side answering junk is a failed pull
            self.num_failed += 1
            raise TransferError(f"prefill worker {base_url} answered the pull with an invalid descriptor: {exc}",
                                502) from exc
        if len(desc.block_ids) != num_blocks_expected or desc.num_tokens != num_tokens_expected:
            self.num_failed += 1
            await self._post(base_url + "/kv/pull/done", msgspec.structs.replace(pull, ok=False))
            raise TransferError(
                f"prefill worker {base_url} offers {len(desc.block_ids)} blocks of a {desc.num_tokens}-token prompt; "
                f"{num_blocks_expected} blocks of a {num_tokens_expected}-token prompt expected",
                502,
            )
        now = time.monotonic()
        start = max(now, self._link_free_at)
        duration = transfer_s(self.profile, self.block_size, len(desc.block_ids)) * self.time_scale
        self._link_free_at = start + duration
        if self._link_free_at > now:
            await asyncio.sleep(self._link_free_at - now)
        try:
            await self._post(base_url + "/kv/pull/done", pull)
        except TransferError as exc:
            # the blocks were read; the prefill side frees them at its abort timeout
            logger.warning("pull-done notification lost: %s", exc.message)
        self.num_pulls += 1
        self.num_pulled_blocks += len(desc.block_ids)
        return desc
