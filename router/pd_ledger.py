"""The gateway's remote-KV reservations: per decode worker, the blocks and transfer bytes of PD requests in flight.

Every routed PD request reserves ``needed_blocks`` on its decode worker (``policies.pd``) before either leg is sent,
and releases them exactly once when the request ends, whatever the outcome (answered, refused, failed, client gone):
``release`` is idempotent and a reservation moved to another decode worker (``move``) is counted there only. While
the decode worker still pulls the KV the request's transfer bytes count as ``bytes_ahead`` on that worker's link;
``transfer_landed`` (the decode leg's first byte) stops that.

Single-threaded (the gateway's event loop); no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from router.metrics import MetricSample

__all__ = ["DecodeLedger", "Reservation", "ledger_samples"]


@dataclass
class Reservation:
    """One PD request's hold on a decode worker.

    Attributes:
        request_id: the gateway's request id.
        worker_id: the decode worker.
        num_blocks: blocks reserved.
        num_transfer_bytes: KV bytes the worker pulls for it.
        is_transferring: the bytes are still on their way.
    """

    request_id: str
    worker_id: str
    num_blocks: int
    num_transfer_bytes: int
    is_transferring: bool = True


class DecodeLedger:
    """Reservations by request and their sums by decode worker (module docstring)."""

    def __init__(self) -> None:
        self._by_request: dict[str, Reservation] = {}
        self._blocks: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self.num_reserved_total = 0
        self.num_released_total = 0

    def reserved_blocks(self, worker_id: str) -> int:
        """Blocks reserved on ``worker_id``."""
        return self._blocks.get(worker_id, 0)

    def bytes_ahead(self, worker_id: str) -> int:
        """Transfer bytes still on their way to ``worker_id``."""
        return self._bytes.get(worker_id, 0)

    def num_reservations(self, worker_id: str) -> int:
        """PD requests holding blocks on ``worker_id``."""
        return self._count.get(worker_id, 0)

    def __len__(self) -> int:
        return len(self._by_request)

    def get(self, request_id: str) -> Reservation | None:
        """The request's reservation, or ``None``."""
        return self._by_request.get(request_id)

    def reserve(self, request_id: str, worker_id: str, num_blocks: int, num_transfer_bytes: int) -> Reservation:
        """Hold ``num_blocks`` on ``worker_id`` for ``request_id``.

        Raises:
            ValueError: the request already holds a reservation (``move`` it instead), or negative amounts.
        """
        if request_id in self._by_request:
            raise ValueError(f"request {request_id} already holds a reservation")
        if num_blocks < 0 or num_transfer_bytes < 0:
            raise ValueError("reservations are non-negative")
        r = Reservation(request_id, worker_id, num_blocks, num_transfer_bytes)
        self._by_request[request_id] = r
        self._blocks[worker_id] = self._blocks.get(worker_id, 0) + num_blocks
        self._bytes[worker_id] = self._bytes.get(worker_id, 0) + num_transfer_bytes
        self._count[worker_id] = self._count.get(worker_id, 0) + 1
        self.num_reserved_total += 1
        return r

    def transfer_landed(self, request_id: str) -> None:
        """The decode worker has the request's KV (its first output byte arrived): its bytes leave the link."""
        r = self._by_request.get(request_id)
        if r is None or not r.is_transferring:
            return
        r.is_transferring = False
        self._sub(self._bytes, r.worker_id, r.num_transfer_bytes)

    def release(self, request_id: str) -> Reservation | None:
        """Drop the request's reservation (idempotent); returns it, or ``None`` if it held none."""
        r = self._by_request.pop(request_id, None)
        if r is None:
            return None
        self._sub(self._blocks, r.worker_id, r.num_blocks)
        self._sub(self._count, r.worker_id, 1)
        if r.is_transferring:
            self._sub(self._bytes, r.worker_id, r.num_transfer_bytes)
        self.num_released_total += 1
        return r

    def move(self, request_id: str, worker_id: str, num_blocks: int, num_transfer_bytes: int) -> Reservation:
        """Re-reserve the request on another decode worker (a retry): the old hold is released first."""
        self.release(request_id)
        return self.reserve(request_id, worker_id, num_blocks, num_transfer_bytes)

    def forget_worker(self, worker_id: str) -> list[str]:
        """A removed worker: drop its reservations; returns the request ids that held one."""
        ids = [rid for rid, r in self._by_request.items() if r.worker_id == worker_id]
        for rid in ids:
            self.release(rid)
        return ids

    @staticmethod
    def _sub(table: dict[str, int], key: str, amount: int) -> None:
        left = table.get(key, 0) - amount
        if left:
            table[key] = left
        else:
            table.pop(key, None)


def ledger_samples(
    ledger: DecodeLedger, decode_worker_ids: Iterable[str], *, num_waiting: int, num_rejected: int
) -> list[MetricSample]:
    """The scrape-time series of disaggregated serving (``GatewayMetrics.add_callback``): per decode worker the
    blocks, requests and in-flight transfer bytes this gateway holds there (0 for an idle one, so a leak shows as a
    level that never returns to 0), the requests waiting for decode room, the 429s for lack of it, and the
    reservations made and released (equal once the gateway is idle)."""
    out: list[MetricSample] = []
    for wid in decode_worker_ids:
        labels = {"worker": wid}
        out.append(("gauge", "kvgate_pd_reserved_blocks",
                    "KV blocks reserved on the decode worker by disaggregated requests in flight.", labels,
                    float(ledger.reserved_blocks(wid))))
        out.append(("gauge", "kvgate_pd_reservations",
                    "Disaggregated requests holding a reservation on the decode worker.", labels,
                    float(ledger.num_reservations(wid))))
        out.append(("gauge", "kvgate_pd_transfer_bytes_ahead",
                    "KV bytes of reserved requests still on their way to the decode worker.", labels,
                    float(ledger.bytes_ahead(wid))))
    out.append(("gauge", "kvgate_pd_waiting_requests", "Disaggregated requests waiting for decode room.", {},
                float(num_waiting)))
    out.append(("counter", "kvgate_pd_capacity_rejected",
                "Disaggregated requests refused with 429 for lack of decode room.", {}, float(num_rejected)))
    out.append(("counter", "kvgate_pd_reservations_made", "Decode reservations made (a retry's move counts again).",
                {}, float(ledger.num_reserved_total)))
    out.append(("counter", "kvgate_pd_reservations_released", "Decode reservations released.", {},
                float(ledger.num_released_total)))
    return out
