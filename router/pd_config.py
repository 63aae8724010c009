"""The ``models[].pd`` section: how a model's disaggregated fleet is driven (``router.pd``).

::

    models:
      - name: llama
        pd:
          protocol: vllm            # vllm (kv_transfer_params, sequential legs) | sglang (bootstrap, both at once)
          kv_bytes_per_token: 131072
          link_bytes_per_s: 25.0e9  # prefill -> decode bandwidth
          transfer_latency_s: 0.0005
          max_reserved_fraction: 1.0
          queue_timeout_s: 5.0      # wait for a decode worker with room, then 429
          max_waiting: 256
          retry_after_s: 1.0
    workers:
      - {id: p0, url: "http://10.0.0.1:8000", model: llama, role: prefill, bootstrap_port: 8998}
      - {id: d0, url: "http://10.0.0.2:8000", model: llama, role: decode}

The handshakes are ``common.pd_protocol``'s; the pair choice and the reservation rule are ``policies.pd``'s.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from common.pd_protocol import PDProtocolName
from policies.pd import PDTransferConfig

Role = Literal["prefill", "decode", "both"]
"""A worker's part in a disaggregated fleet (``workers[].role``); ``both`` serves either leg and plain requests."""


class PDConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A model served disaggregated.

    Attributes:
        protocol: ``vllm`` (``kv_transfer_params``: the prefill leg first, its answer's params into the decode
            leg) or ``sglang`` (``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``: both legs at once).
        kv_bytes_per_token: KV bytes per token, all layers.
        link_bytes_per_s: prefill -> decode transfer bandwidth, bytes/s.
        transfer_latency_s: fixed cost per transfer, seconds.
        max_reserved_fraction: share of a decode worker's GPU blocks this gateway may reserve, in (0, 1].
        queue_timeout_s: how long a request waits for a decode worker with room before a 429, seconds.
        max_waiting: requests waiting for decode room at once; more get a 429 at once.
        retry_after_s: the ``Retry-After`` of those 429s, seconds.
    """

    protocol: PDProtocolName = "vllm"
    kv_bytes_per_token: int = 131072
    link_bytes_per_s: float = 25.0e9
    transfer_latency_s: float = 5.0e-4
    max_reserved_fraction: float = 1.0
    queue_timeout_s: float = 5.0
    max_waiting: int = 256
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        """Raises:
        ValueError: a value out of range (the message names the key).
        """
        for name in ("link_bytes_per_s", "transfer_latency_s", "max_reserved_fraction", "queue_timeout_s",
                     "retry_after_s"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        self.transfer()  # the link's own checks
        if self.queue_timeout_s < 0:
            raise ValueError(f"queue_timeout_s must be >= 0, got {self.queue_timeout_s}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be positive, got {self.retry_after_s}")

    def transfer(self) -> PDTransferConfig:
        """The link and reservation rule as ``policies.pd`` takes them."""
        return PDTransferConfig(
            kv_bytes_per_token=self.kv_bytes_per_token,
            link_bytes_per_s=self.link_bytes_per_s,
            transfer_latency_s=self.transfer_latency_s,
            max_reserved_fraction=self.max_reserved_fraction,
        )
