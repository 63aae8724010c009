"""Choosing the pair of a disaggregated request: a decode worker by load, memory and transfer, then a prefill worker
by cache-aware TTFT. Pure and synchronous, like every policy.

Decode side, for a request of ``n`` prompt tokens and at most ``m`` output tokens, block size ``B``, on a decode
worker ``d`` whose own prefix cache holds ``k_d`` of the prompt's tokens (its index entries)::

    needed_blocks(d)    = ceil((n + m) / B) - floor(k_d / B)            what the request will hold there
    available_blocks(d) = min(free_blocks(d), capacity(d) - reserved_blocks(d))
        free_blocks       the worker's free GPU blocks, as last polled
        capacity          its total GPU blocks times ``max_reserved_fraction``
        reserved_blocks   blocks this gateway reserved there for PD requests still in flight (the ledger)
    fits(d)             = needed_blocks(d) <= available_blocks(d)        never more transfers than it can resume

    transfer_s(d)   = transfer_latency_s + (bytes_ahead(d) + (n - k_d) * kv_bytes_per_token) / link_bytes_per_s
        bytes_ahead       KV still on its way to d for earlier requests (one link per decode worker, FIFO)
    decode_cost_s(d) = transfer_s(d) + decode_load_s(d)                 (``TTFTCostModel.decode_load_s``)

The decode worker is the fitting candidate of least ``decode_cost_s`` (ties: more available blocks, then
configuration order); a fitting session owner keeps the session's decode leg (its prefix is local, so it also
pulls less). No candidate fits: the decision says ``no_decode_capacity`` and the gateway queues the request (or
answers 429), unless the request needs more than any of them may ever hold (``never_fits``: a 400). Prefill
side: ``CacheAwarePolicy`` over the prefill workers, whose index entries hold the prompt's prefix; each prefill
worker's pair score is its estimated TTFT plus ``transfer_s`` to the chosen decode worker (the same link for every
prefill worker here, so the ranking is the TTFT's; the score is what the client waits for).
"""

from __future__ import annotations

import msgspec

from policies.base import Decision, Policy, RequestView, Snapshot, WorkerState
from policies.cost_model import TTFTCostModel

__all__ = ["DecodeCandidate", "PDPairDecision", "PDPolicy", "PDTransferConfig"]

REASON_NO_DECODE_CAPACITY = "no_decode_capacity"
REASON_NO_DECODE_WORKER = "no_decode_worker"


class PDTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prefill -> decode link and the decode-side reservation rule (module docstring).

    Attributes:
        kv_bytes_per_token: KV bytes per token, all layers (Llama-3-8B bf16: 131,072).
        link_bytes_per_s: prefill -> decode transfer bandwidth (200 Gb/s RDMA: 25e9).
        transfer_latency_s: fixed cost per transfer.
        max_reserved_fraction: share of a decode worker's GPU blocks this gateway may reserve, in (0, 1].
    """

    kv_bytes_per_token: int = 131072
    link_bytes_per_s: float = 25.0e9
    transfer_latency_s: float = 5.0e-4
    max_reserved_fraction: float = 1.0

    def __post_init__(self) -> None:
        """Raises:
        ValueError: a non-positive bandwidth or byte count, a negative latency, a fraction outside (0, 1].
        """
        if self.kv_bytes_per_token <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError("kv_bytes_per_token and link_bytes_per_s must be positive")
        if self.transfer_latency_s < 0:
            raise ValueError("transfer_latency_s must be >= 0")
        if not 0 < self.max_reserved_fraction <= 1:
            raise ValueError("max_reserved_fraction must be in (0, 1]")


class DecodeCandidate(msgspec.Struct, frozen=True, gc=False):
    """One decode worker at decision time.

    Attributes:
        worker_id: the worker.
        is_healthy: passes health checks and its circuit is closed.
        is_draining: takes no new requests.
        num_free_blocks: free GPU blocks, as last polled (``/load``).
        num_total_blocks: GPU blocks in all.
        num_reserved_blocks: blocks this gateway reserved there for PD requests in flight.
        num_bytes_ahead: KV bytes still being transferred to it for earlier requests.
        num_gpu_cached_tokens: prompt tokens its own prefix cache holds (index match).
        num_running_requests: requests in flight there through this gateway.
        num_inflight_prompt_tokens: their prompt tokens (the context their decode steps read).
    """

    worker_id: str
    num_free_blocks: int
    num_total_blocks: int
    is_healthy: bool = True
    is_draining: bool = False
    num_reserved_blocks: int = 0
    num_bytes_ahead: int = 0
    num_gpu_cached_tokens: int = 0
    num_running_requests: int = 0
    num_inflight_prompt_tokens: int = 0


class PDPairDecision(msgspec.Struct, frozen=True, gc=False):
    """Both legs of one PD decision.

    Attributes:
        prefill: the prefill leg (``CacheAwarePolicy``'s decision; ``scores`` are estimated TTFTs plus the transfer
            to the chosen decode worker).
        decode: the decode leg (``scores`` are ``decode_cost_s``; ``worker_id`` ``None`` when none fits).
        num_reserved_blocks: ``needed_blocks`` on the chosen decode worker (what the gateway reserves).
        num_transfer_bytes: KV bytes the decode worker will pull, ``(n - k_d) * kv_bytes_per_token``.
        transfer_s: the chosen decode worker's ``transfer_s``.
        fits: per decode worker id, whether the request fits there (the admin's decision list).
    """

    prefill: Decision
    decode: Decision
    num_reserved_blocks: int = 0
    num_transfer_bytes: int = 0
    transfer_s: float = 0.0
    fits: dict[str, bool] = msgspec.field(default_factory=dict)

    @property
    def is_routable(self) -> bool:
        """Whether both legs have a worker."""
        return self.prefill.worker_id is not None and self.decode.worker_id is not None


class PDPolicy:
    """The pair choice of the module docstring.

    Args:
        prefill_policy: chooses among prefill workers (``CacheAwarePolicy``, possibly wrapped by session stickiness).
        cost_model: gives the decode load (``TTFTCostModel.decode_load_s``).
        config: the link and the reservation rule.
    """

    name = "pd"

    def __init__(self, prefill_policy: Policy, cost_model: TTFTCostModel, config: PDTransferConfig) -> None:
        self.prefill_policy = prefill_policy
        self.cost_model = cost_model
        self.config = config

    def needed_blocks(self, view: RequestView, candidate: DecodeCandidate) -> int:
        """Blocks the request will hold on ``candidate`` (module docstring)."""
        b = view.block_size
        k = min(candidate.num_gpu_cached_tokens, view.num_prompt_tokens)
        return -(-(view.num_prompt_tokens + view.num_max_output_tokens) // b) - k // b

    def capacity_blocks(self, candidate: DecodeCandidate) -> int:
        """Blocks the gateway may reserve on ``candidate`` when nothing is in flight there (module docstring)."""
        return int(candidate.num_total_blocks * self.config.max_reserved_fraction)

    def available_blocks(self, candidate: DecodeCandidate) -> int:
        """Blocks the gateway may still reserve on ``candidate`` (module docstring)."""
        return min(candidate.num_free_blocks, self.capacity_blocks(candidate) - candidate.num_reserved_blocks)

    def never_fits(self, view: RequestView, decodes: tuple[DecodeCandidate, ...]) -> tuple[int, int] | None:
        """``(the fewest blocks the request needs on one, the most any may hold)`` when no healthy, undrained
        decode worker could hold the request even with nothing else in flight there (``needed_blocks >
        capacity_blocks`` on every one: waiting for capacity cannot help), else ``None`` (also with no usable
        decode worker at all)."""
        usable = [d for d in decodes if d.is_healthy and not d.is_draining]
        if not usable or any(self.needed_blocks(view, d) <= self.capacity_blocks(d) for d in usable):
            return None
        return min(self.needed_blocks(view, d) for d in usable), max(self.capacity_blocks(d) for d in usable)

    def transfer_bytes(self, view: RequestView, candidate: DecodeCandidate) -> int:
        """KV bytes ``candidate`` would pull for the request."""
        k = min(candidate.num_gpu_cached_tokens, view.num_prompt_tokens)
        return (view.num_prompt_tokens - k) * self.config.kv_bytes_per_token

    def transfer_s(self, view: RequestView, candidate: DecodeCandidate) -> float:
        """The pull's expected duration including the bytes ahead on the link (module docstring)."""
        c = self.config
        return c.transfer_latency_s + (candidate.num_bytes_ahead + self.transfer_bytes(view, candidate)) / (
            c.link_bytes_per_s
        )

    def decode_cost_s(self, view: RequestView, candidate: DecodeCandidate) -> float:
        """``transfer_s + decode_load_s`` (module docstring)."""
        load = self.cost_model.decode_load_s(
            WorkerState(
                candidate.worker_id,
                num_running_requests=candidate.num_running_requests,
                num_inflight_prompt_tokens=candidate.num_inflight_prompt_tokens,
            ),
            view.num_prompt_tokens,
            view.num_max_output_tokens,
        )
        return self.transfer_s(view, candidate) + load

    def select_decode(
        self, view: RequestView, decodes: tuple[DecodeCandidate, ...], session_owner: str | None = None
    ) -> tuple[Decision, dict[str, bool], int]:
        """The decode leg alone: ``(decision, fits per worker, needed blocks on the chosen one)``."""
        if not decodes:
            return Decision(None, REASON_NO_DECODE_WORKER), {}, 0
        scores: dict[str, float] = {}
        fits: dict[str, bool] = {}
        keyed: list[tuple[int, int, int, str]] = []
        needed: dict[str, int] = {}
        for order, d in enumerate(decodes):
            if not d.is_healthy or d.is_draining:
                continue
            cost = self.decode_cost_s(view, d)
            scores[d.worker_id] = cost
            need = needed[d.worker_id] = self.needed_blocks(view, d)
            available = self.available_blocks(d)
            fits[d.worker_id] = need <= available
            if fits[d.worker_id]:
                keyed.append((round(cost * 1e6), -available, order, d.worker_id))
        if not scores:
            return Decision(None, REASON_NO_DECODE_WORKER), fits, 0
        if not keyed:
            return Decision(None, REASON_NO_DECODE_CAPACITY, scores), fits, 0
        keyed.sort()
        ranking = tuple(k[3] for k in keyed)
        chosen, reason = ranking[0], "min_decode_cost"
        if session_owner is not None and fits.get(session_owner):
            if session_owner != chosen:
                ranking = (session_owner, *[w for w in ranking if w != session_owner])
            chosen, reason = session_owner, "sticky"
        return Decision(chosen, reason, scores, ranking=ranking), fits, needed[chosen]

    def select(
        self,
        view: RequestView,
        prefill_snapshot: Snapshot,
        decodes: tuple[DecodeCandidate, ...],
        decode_session_owner: str | None = None,
        prefill_decision: Decision | None = None,
    ) -> PDPairDecision:
        """Both legs (module docstring). Never raises: a leg without a worker has ``worker_id`` ``None``.

        ``prefill_decision``: the prefill leg decided already (the gateway's session stickiness claims it through
        the session store); ``None``: ``prefill_policy`` decides it here.
        """
        decode, fits, num_blocks = self.select_decode(view, decodes, decode_session_owner)
        prefill = (
            prefill_decision if prefill_decision is not None else self.prefill_policy.select(view, prefill_snapshot)
        )
        if decode.worker_id is None:
            return PDPairDecision(prefill, decode, fits=fits)
        chosen = next(d for d in decodes if d.worker_id == decode.worker_id)
        transfer = self.transfer_s(view, chosen)
        pair_scores = {w: s + transfer for w, s in prefill.scores.items()}
        prefill = msgspec.structs.replace(prefill, scores=pair_scores)
        return PDPairDecision(
            prefill,
            decode,
            num_reserved_blocks=num_blocks,
            num_transfer_bytes=self.transfer_bytes(view, chosen),
            transfer_s=transfer,
            fits=fits,
        )
