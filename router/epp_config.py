"""The ``endpoint_picker:`` section of the gateway config (``router.epp`` runs it).

Split from ``router.epp`` so that the config tree (``router.config.GatewayConfig.endpoint_picker``) holds the typed
section without importing grpcio (the ``epp`` extra).

YAML::

    endpoint_picker:                 # null (default): no ext_proc server
      host: 0.0.0.0
      port: 9002                     # the inference extension's EPP gRPC port
      metadata_namespace: envoy.lb   # the dynamic metadata namespace of the picked endpoints
      subset_namespace: envoy.lb.subset_hint
      num_fallback_endpoints: 0      # endpoints listed after the primary (the proxy tries them in order)
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["EndpointPickerConfig"]


class EndpointPickerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``endpoint_picker:`` section (module docstring)."""

    host: str = "0.0.0.0"
    """Address the ext_proc gRPC server binds."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9002
    """Its port (0 picks a free one: tests)."""
    metadata_namespace: str = "envoy.lb"
    """Namespace of the ``x-gateway-destination-endpoint`` dynamic metadata entry (the protocol's default)."""
    subset_namespace: str = "envoy.lb.subset_hint"
    """Filter metadata namespace of the data plane's ``x-gateway-destination-endpoint-subset`` (default)."""
    num_fallback_endpoints: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    """Endpoints of the decision's ranking listed after the chosen one, comma separated."""

    def __post_init__(self) -> None:
        if not self.metadata_namespace.strip():
            raise ValueError("metadata_namespace must not be empty")
