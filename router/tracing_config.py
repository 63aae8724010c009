"""The ``tracing:`` section of the gateway config (``router.tracing`` runs it).

Split from ``router.tracing`` so that the config tree (``router.config.GatewayConfig.tracing``) holds the typed
section without importing OpenTelemetry, which is an optional extra (``pip install kvgate[otel]``).

YAML::

    tracing:
      enabled: true                            # default false: no tracer, no span objects
      otlp_endpoint: http://127.0.0.1:4317     # OTLP/gRPC collector
      otlp_insecure: true                      # plaintext gRPC (a collector on the pod's network)
      service_name: kvgate                     # the resource's service.name
      sample_ratio: 1.0                        # TraceIdRatioBased, 0..1 (a client's sampled traceparent wins)
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["TracingConfig"]


class TracingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``tracing:`` section (module docstring)."""

    enabled: bool = False
    """Trace requests (spans for parse, tokenize, match, select, proxy, first byte); off by default."""
    otlp_endpoint: str = "http://127.0.0.1:4317"
    """The OTLP/gRPC collector the spans are exported to (batched)."""
    otlp_insecure: bool = True
    """Plaintext gRPC to the collector."""
    service_name: str = "kvgate"
    """``service.name`` of the exported resource."""
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    """Fraction of requests traced (parent-based: a client's ``traceparent`` decides for its request)."""

    def __post_init__(self) -> None:
        if self.enabled and not self.otlp_endpoint.strip():
            raise ValueError("otlp_endpoint must not be empty when tracing is enabled")
        if not self.service_name.strip():
            raise ValueError("service_name must not be empty")
