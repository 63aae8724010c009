"""The two prefill/decode handshakes the engines speak, as typed structs and pure request rewrites.

A disaggregated request has two legs: the **prefill leg** computes the prompt's KV on a prefill worker, the
**decode leg** pulls that KV onto a decode worker and streams the answer. The engines agree on the handshake
between the legs in one of two ways; both are written down here, field by field, with the source of each field,
so that the gateway (``router``) and the reference worker (``workers``) build and read exactly the same bodies.
Nothing here does I/O.

vLLM: ``kv_transfer_params`` (sequential legs)
    Sources: vLLM ``vllm/entrypoints/openai/protocol.py`` (``CompletionRequest`` / ``ChatCompletionRequest``
    field ``kv_transfer_params: dict[str, Any] | None``, "KVTransfer parameters used for disaggregated serving";
    ``CompletionResponse`` / ``ChatCompletionResponse`` field of the same name), the connectors
    ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` (``NixlConnectorScheduler
    .request_finished`` / ``update_state_after_alloc``, ``NIXL_CONNECTOR_VERSION = 2``, which added
    ``remote_request_id``) and ``.../v1/mooncake_connector.py``, and the reference proxy
    ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``.

    1. The proxy sends the client's body to a prefill worker with ``stream: false``, ``max_tokens: 1`` (and
       ``max_completion_tokens: 1`` when the body has it), no ``stream_options``, no ``min_tokens`` /
       ``min_completion_tokens``, and ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill":
       false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``
       (``prefill_leg_body``). The same ``X-Request-Id`` header goes on both legs.
    2. The prefill worker computes the prompt, samples one token and, because the request finished by length
       (``FINISHED_LENGTH_CAPPED``; an abort or a stop frees at once), keeps its blocks alive for the decode side
       (NIXL: at most ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` = 480 s, then frees them). Its response carries
       ``kv_transfer_params`` = ``{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...],
       "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ..., "remote_port": ..., "tp_size": ...}``
       (NIXL; Mooncake's connector returns only the two flags and ``remote_host`` / ``remote_port``).
    3. The proxy copies those params, unchanged, into the client's original body and streams the decode worker's
       answer to the client (``decode_leg_body``). The decode worker allocates blocks for the prompt, reads the
       remote blocks it does not already hold in its own prefix cache, tells the prefill side it is done (which
       frees the blocks there), recomputes the last prompt token and decodes.

SGLang: bootstrap fields (concurrent legs)
    Sources: SGLang ``python/sglang/srt/entrypoints/openai/protocol.py`` and ``managers/io_struct.py``
    (``bootstrap_host: str | list[str]``, ``bootstrap_port: int | list[int | None] | None``, ``bootstrap_room:
    int | list[int]``, "For PD disaggregation"), ``server_args.py`` (``disaggregation_bootstrap_port = 8998``), the
    router ``sgl-router/src/routers/pd_types.rs`` (``Bootstrap::add_bootstrap_info``: host = the prefill URL's
    hostname, port = the prefill worker's configured bootstrap port, room = a fresh random integer per request)
    and ``pd_router.rs`` (``execute_dual_dispatch``), and ``sglang_router/mini_lb.py`` (``_generate_bootstrap_room``
    = ``random.randint(0, 2**63 - 1)``; both legs posted at once with ``asyncio.gather``; the client gets the
    decode leg's answer).

    The same body, with the three fields added, goes to the prefill worker and to the decode worker at the same
    time (``bootstrap_body``); the room pairs the two legs. A batch (a list prompt) carries one entry per prompt
    in each field; a single prompt carries scalars.
"""

from __future__ import annotations

import random
from typing import Any, Literal

import msgspec

PDProtocolName = Literal["vllm", "sglang"]
"""Which handshake a model's disaggregated fleet speaks."""

DEFAULT_BOOTSTRAP_PORT = 8998
"""SGLang's ``--disaggregation-bootstrap-port`` default (``server_args.py``)."""

MAX_BOOTSTRAP_ROOM = 2**63 - 1
"""Largest room ``mini_lb._generate_bootstrap_room`` draws (``random.randint(0, 2**63 - 1)``)."""

NIXL_ABORT_REQUEST_TIMEOUT_S = 480.0
"""vLLM ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` default: how long a prefill worker keeps blocks nobody pulled."""

PREFILL_ONLY_FIELDS = ("min_tokens", "min_completion_tokens")
"""Fields the reference proxy removes from the prefill leg (unsupported there) and keeps on the decode leg."""


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=False):
    """vLLM's ``kv_transfer_params`` object, both directions (NIXL connector shape; module docstring).

    Unknown keys are ignored when decoding (connectors add their own, e.g. ``tp_size``), and every field is
    optional because the request side (step 1) sends them as ``null``.

    Attributes:
        do_remote_decode: set on the prefill leg's request: "keep the KV for a decode worker"
            (``toy_proxy_server.send_request_to_service``; read in ``update_state_after_alloc`` and
            ``request_finished``).
        do_remote_prefill: set on the decode leg's request (copied from the prefill response): "the prompt's KV
            is on a remote worker; pull it" (``get_num_new_matched_tokens``).
        remote_engine_id: the prefill engine's id (``NixlConnectorScheduler.engine_id``; the
            ``kv_transfer_config.engine_id``), so the decode side knows whose agent to read from.
        remote_block_ids: the prefill worker's block ids holding the prompt, in order (``request_finished``'s
            ``block_ids``: the request's blocks of its first KV cache group).
        remote_host: where the prefill side serves the transfer (NIXL: ``VLLM_NIXL_SIDE_CHANNEL_HOST``; Mooncake:
            the worker's IP).
        remote_port: its port (NIXL: ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + data-parallel rank).
        remote_request_id: the prefill worker's own id of the request, which names the parked blocks
            (NIXL connector version 2).
        tp_size: the prefill engine's tensor-parallel size (NIXL ``request_finished``; read by
            ``NixlConnectorMetadata._add_new_req`` with a default of 1).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1

    @property
    def is_complete_remote_prefill(self) -> bool:
        """Whether a decode worker has everything it needs to pull (NIXL ``update_state_after_alloc`` checks
        ``remote_block_ids`` and the engine id, request id, host and port)."""
        return (
            self.do_remote_prefill
            and self.remote_block_ids is not None
            and self.remote_engine_id is not None
            and self.remote_request_id is not None
            and self.remote_host is not None
            and self.remote_port is not None
        )


PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The ``kv_transfer_params`` the reference proxy puts on every prefill leg, exactly (step 1)."""


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The vLLM prefill leg of a client body (step 1 of the module docstring); ``body`` is not changed.

    Args:
        body: the client's decoded JSON body (completions or chat completions).

    Returns:
        A new mapping: ``kv_transfer_params`` asking for a remote decode, ``stream: false``, ``max_tokens: 1``
        (``max_completion_tokens: 1`` when present), without ``stream_options``, ``min_tokens`` and
        ``min_completion_tokens``.
    """
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    for key in PREFILL_ONLY_FIELDS:
        out.pop(key, None)
    return out


def decode_leg_body(body: dict[str, Any], prefill_params: dict[str, Any] | None) -> dict[str, Any]:
    """The vLLM decode leg (step 3): the client's body with the prefill answer's ``kv_transfer_params``.

    Args:
        body: the client's decoded JSON body, as received.
        prefill_params: the prefill response's ``kv_transfer_params`` (``None`` or empty: the reference proxy
            then sends the body unchanged, and the decode worker computes the prompt itself).

    Returns:
        A new mapping; ``body`` is not changed.
    """
    out = dict(body)
    if prefill_params:
        out["kv_transfer_params"] = prefill_params
    return out


class BootstrapFields(msgspec.Struct, frozen=True):
    """SGLang's three PD fields for one prompt (module docstring).

    Attributes:
        bootstrap_host: the prefill worker's hostname (the host of its URL: ``pd_types.rs get_hostname``,
            ``mini_lb`` ``urllib.parse.urlparse(prefill_server).hostname``).
        bootstrap_port: the prefill worker's bootstrap server port (``--disaggregation-bootstrap-port``, default
            8998; the router takes it per prefill worker from ``--prefill URL PORT`` or the pod annotation
            ``sglang.ai/bootstrap-port``); ``None`` where the worker declared none.
        bootstrap_room: the rendezvous id shared by both legs, in ``[0, 2**63 - 1]``.
    """

    bootstrap_host: str
    bootstrap_port: int | None
    bootstrap_room: int


def new_bootstrap_room(rng: random.Random) -> int:
    """A fresh room, drawn as ``mini_lb._generate_bootstrap_room`` draws it (uniform in ``[0, 2**63 - 1]``)."""
    return rng.randint(0, MAX_BOOTSTRAP_ROOM)


def bootstrap_body(body: dict[str, Any], fields: BootstrapFields) -> dict[str, Any]:
    """The body both SGLang legs get: the client's, with the bootstrap fields of a single prompt added.

    Returns:
        A new mapping; ``body`` is not changed.
    """
    out = dict(body)
    out["bootstrap_host"] = fields.bootstrap_host
    out["bootstrap_port"] = fields.bootstrap_port
    out["bootstrap_room"] = fields.bootstrap_room
    return out


class BootstrapRequest(msgspec.Struct, frozen=True):
    """The bootstrap fields as a worker reads them from a request body (scalars only: the reference worker
    serves one prompt per request, ``n == 1``).

    Attributes:
        bootstrap_host: ``None`` when the request is not a PD leg.
        bootstrap_port: ``None`` where the router had no port for the prefill worker.
        bootstrap_room: ``None`` when the request is not a PD leg.
    """

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    @property
    def is_pd_leg(self) -> bool:
        """Whether the request names a room and a prefill host."""
        return self.bootstrap_room is not None and self.bootstrap_host is not None
