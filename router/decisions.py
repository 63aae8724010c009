"""The gateway's record of its routing decisions: ``RecentAssignments`` (how many of the latest decisions went to
each worker, the policies' last tie-break), and the entries of ``/admin/decisions`` (``DecisionRecord``, whose
``cost_terms`` gives every candidate's ranking cost term by term, and ``PDRecord`` for a disaggregated pair)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import msgspec

from policies import cost_terms
from policies.base import RequestView, Snapshot

__all__ = ["DecisionRecord", "DecisionRing", "PDRecord", "RecentAssignments"]


class RecentAssignments:
    """How many of the latest decisions went to each worker: a window of ``num_per_worker`` decisions per worker of
    the fleet (``WorkerState.num_recent_assignments``, the policies' last tie-break before configuration order).

    O(1) per decision: a ring of worker ids and their counts.
    """

    __slots__ = ("_ring", "counts", "_num_per_worker")

    def __init__(self, num_per_worker: int = 4) -> None:
        self._ring: deque[str] = deque()
        self.counts: dict[str, int] = {}
        self._num_per_worker = num_per_worker

    def add(self, worker_id: str, num_workers: int) -> None:
        """Count one decision for ``worker_id``, forgetting the oldest past ``num_per_worker * num_workers``."""
        ring, counts = self._ring, self.counts
        ring.append(worker_id)
        counts[worker_id] = counts.get(worker_id, 0) + 1
        while len(ring) > self._num_per_worker * max(1, num_workers):
            old = ring.popleft()
            n = counts[old] - 1
            if n:
                counts[old] = n
            else:
                del counts[old]


class DecisionRecord(msgspec.Struct, frozen=True, gc=False):
    """One entry of ``/admin/decisions``; ``cost_terms`` gives every candidate's ranking cost term by term from the
    decision's own inputs (``request``, ``snapshot``, ``policy``, which ``/admin/decisions`` does not show)."""

    request_id: str
    model: str
    worker_id: str | None
    reason: str
    detail: str
    session_key: str | None
    num_prompt_tokens: int
    predicted_cached_tokens: int
    scores: Mapping[str, float]
    cached_tokens: dict[str, int]
    decision_s: float
    at_s: float
    request: RequestView | None = None
    snapshot: Snapshot | None = None
    policy: object = None

    def cost_terms(self) -> dict[str, dict[str, float | int | bool]]:
        """Each candidate's cost terms (``policies.cost_terms``) by worker id; empty for a forced worker or a
        policy that ranks by no cost."""
        if self.request is None or self.snapshot is None or self.reason == "forced":
            return {}
        return {w: msgspec.structs.asdict(t) for w, t in cost_terms(self.policy, self.request, self.snapshot).items()}


class PDRecord(msgspec.Struct, frozen=True, gc=False):
    """One disaggregated entry of ``/admin/decisions`` (``router.pd``): both legs with every candidate's score.

    Attributes:
        request_id: the gateway's id.
        model: the model.
        protocol: ``vllm`` or ``sglang``.
        prefill_worker_id: the prefill leg's chosen worker.
        decode_worker_id: the decode leg's chosen worker.
        prefill_reason: the prefill decision's reason.
        decode_reason: the decode decision's reason.
        prefill_scores: per prefill candidate, estimated TTFT plus the transfer to the decode worker (seconds).
        decode_scores: per decode candidate, transfer plus decode load (seconds).
        decode_fits: per decode candidate, whether the request fit its free blocks.
        predicted_cached_tokens: per prefill candidate, predicted cached prompt tokens.
        num_reserved_blocks: blocks reserved on the decode worker.
        num_transfer_bytes: KV bytes the decode worker pulls.
        transfer_s: expected transfer time, seconds.
        num_prompt_tokens: prompt tokens.
        session_key: the session key, or ``None``.
        decision_s: time the decision took, seconds.
        at_s: when it was made (monotonic).
        reported_cached_tokens: cached tokens the prefill worker reported (the honesty check), or ``None``.
        prefill_served_by: the worker that answered the prefill leg (after retries), or ``None``.
        decode_served_by: the worker whose answer was relayed, or ``None``.
        outcome: ``ok``, ``client_gone``, the error's class name, or ``status_<N>``: a worker's error answer
            (status N >= 400, e.g. a decode worker's 503 ``kv_transfer_refused``) relayed to the client.
        kind: ``pd`` (aggregated entries are ``DecisionRecord``).
    """

    request_id: str
    model: str
    protocol: str
    prefill_worker_id: str | None
    decode_worker_id: str | None
    prefill_reason: str
    decode_reason: str
    prefill_scores: dict[str, float]
    decode_scores: dict[str, float]
    decode_fits: dict[str, bool]
    predicted_cached_tokens: dict[str, int]
    num_reserved_blocks: int
    num_transfer_bytes: int
    transfer_s: float
    num_prompt_tokens: int
    session_key: str | None
    decision_s: float
    at_s: float
    reported_cached_tokens: int | None = None
    prefill_served_by: str | None = None
    decode_served_by: str | None = None
    outcome: str = "ok"
    kind: str = "pd"


class FinishedRequest(Protocol):
    """What ``outcome_name`` reads of a finished request (``router.proxy.ProxyOutcome``)."""

    @property
    def error(self) -> object: ...
    @property
    def is_client_gone(self) -> bool: ...
    @property
    def status(self) -> int | None: ...


def outcome_name(outcome: FinishedRequest | None) -> str:
    """The outcome a record keeps of a finished request (``PDRecord.outcome``, ``DecisionRing.settle``):
    ``client_gone`` (it left, or nothing was decided), the error's class name, ``status_<N>`` for a worker's error
    answer (N >= 400) relayed as it was, else ``ok``."""
    if outcome is None:
        return "client_gone"
    if outcome.error is not None:
        return type(outcome.error).__name__
    if outcome.is_client_gone:
        return "client_gone"
    if outcome.status is not None and outcome.status >= 400:
        return f"status_{outcome.status}"
    return "ok"


def _drop_policy(obj: Any) -> None:
    """``enc_hook`` of ``DecisionRing``: the one field msgpack cannot carry, ``DecisionRecord.policy``, goes as nil
    (the ring keeps the object beside the buffer)."""
    return None


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_drop_policy)
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {
    DecisionRecord: msgspec.msgpack.Decoder(DecisionRecord), PDRecord: msgspec.msgpack.Decoder(PDRecord)}


class DecisionRing:
    """The latest decisions, oldest first, at most ``maxlen`` (``/admin/decisions``; the oldest goes first).

    Each is kept as one msgpack buffer (``DecisionRecord.policy``, an object shared by every decision of a policy,
    beside it) and decoded when read, an equal record. A record as built is some 40 small values (its
    candidates' ``WorkerState`` items, scores and pending prefills: ints, floats, short tuples); the last
    ``maxlen`` of them outlive a load peak, each in a page of the allocator's small size classes that the peak's
    transient values shared, so 1,024 records (``loadgen.fleet``'s gateway) kept about 10 MB of those pages
    resident after the peak's values were freed (``benchmarks.soak``'s docstring). One buffer a record (1-2 KiB,
    a size class the ring alone fills) keeps none of them. Encoding costs a few microseconds a decision.
    """

    __slots__ = ("_items", "_answers")

    def __init__(self, maxlen: int) -> None:
        self._items: deque[tuple[type, object, bytes]] = deque(maxlen=maxlen)
        self._answers: OrderedDict[str, bytes] = OrderedDict()
        """An aggregated decision's answer by request id (``settle``), the latest ``maxlen``, one buffer each."""

    @property
    def maxlen(self) -> int:
        """Records kept."""
        return self._items.maxlen or 0

    def append(self, record: DecisionRecord | PDRecord) -> None:
        """Keep ``record`` as the newest, dropping the oldest past ``maxlen``. O(the record's size).

        A decision for a request id that an earlier one had (a client's own ``x-request-id`` sent again) drops the
        earlier one's answer: the id's answer is its newest decision's, ``None`` until that one settles."""
        policy = record.policy if isinstance(record, DecisionRecord) else None
        self._items.append((type(record), policy, _ENCODER.encode(record)))
        self._answers.pop(record.request_id, None)

    def settle(self, request_id: str, served_by: str | None, reported_cached_tokens: int | None,
               outcome: str) -> None:
        """Keep the answer of an aggregated decision's request (``answer``): the worker that served it after retries
        (or ``None``), the cached tokens it reported (or ``None``: no usage), and the outcome (``ok``,
        ``client_gone``, ``status_<N>`` or the error's class name). O(1); the oldest answer goes past ``maxlen``."""
        answers = self._answers
        answers[request_id] = _ENCODER.encode((served_by, reported_cached_tokens, outcome))
        answers.move_to_end(request_id)
        if len(answers) > self.maxlen:
            answers.popitem(last=False)

    def answer(self, request_id: str) -> dict[str, str | int | None] | None:
        """``{"served_by", "reported_cached_tokens", "outcome"}`` as ``settle`` kept them, or ``None`` (in flight,
        or a prefill/decode pair, whose record holds its own)."""
        blob = self._answers.get(request_id)
        if blob is None:
            return None
        served_by, reported, outcome = msgspec.msgpack.decode(blob)
        return {"served_by": served_by, "reported_cached_tokens": reported, "outcome": outcome}

    @staticmethod
    def _decode(item: tuple[type, object, bytes]) -> DecisionRecord | PDRecord:
        kind, policy, blob = item
        record: DecisionRecord | PDRecord = _DECODERS[kind].decode(blob)
        if isinstance(record, DecisionRecord) and policy is not None:
            record = msgspec.structs.replace(record, policy=policy)
        return record

    def latest(self, limit: int) -> list[DecisionRecord | PDRecord]:
        """The newest ``limit`` records (``limit <= 0``: none), oldest first; decodes only those."""
        items = self._items
        num = max(0, min(limit, len(items)))
        return [self._decode(items[i]) for i in range(len(items) - num, len(items))]

    def __getitem__(self, i: int) -> DecisionRecord | PDRecord:
        return self._decode(self._items[i])

    def __iter__(self) -> Iterator[DecisionRecord | PDRecord]:
        return (self._decode(item) for item in list(self._items))

    def __len__(self) -> int:
        return len(self._items)
