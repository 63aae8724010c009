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
    ``remote_request_id``) and, in vLLM 0.32 (``NIXL_CONNECTOR_VERSION = 14``, ``.../v1/nixl/metadata.py``), the
    split package ``.../v1/nixl/pull_scheduler.py`` (``NixlPullScheduler.request_finished``: block ids per KV cache
    group, and ``dcp_size``, ``pp_size``, ``remote_num_tokens``, ``remote_blocks_expiry_time``, ``transfer_mode``;
    ``get_num_new_matched_tokens`` loads ``min(remote_num_tokens, prompt tokens)``), and the reference proxy
    ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``. What vLLM 0.32 (CPU build, NIXL's UCX backend)
    actually answers is pinned by ``tests/interop/test_vllm_pd.py``.

    1. The proxy sends the client's body to a prefill worker with ``stream: false``, ``max_tokens: 1`` (and
       ``max_completion_tokens: 1`` when the body has it), no ``stream_options``, no ``min_tokens`` /
       ``min_completion_tokens``, and ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill":
       false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``
       (``prefill_leg_body``). The same ``X-Request-Id`` header goes on both legs.
    2. The prefill worker computes the prompt, samples one token and, because the request finished by length
       (``FINISHED_LENGTH_CAPPED``; an abort or a stop frees at once), keeps its blocks alive for the decode side
       (NIXL: at most ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` = 480 s, then frees them). Its response carries
       ``kv_transfer_params`` = ``{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids":
       [[...]], "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ..., "remote_port": ...,
       "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": ..., "remote_blocks_expiry_time": null,
       "transfer_mode": "pull"}`` (NIXL in vLLM 0.32: one list of block ids per KV cache group; earlier versions
       sent one flat list and no field after ``tp_size``); vLLM 0.32's scheduler adds
       ``remote_prefill_cached_tokens``, the prefill side's prefix-cache hits, which the decode worker reports as
       its own ``cached_tokens`` (``remote_prefill_cached_tokens``). vLLM 0.32's ``MooncakeConnector`` answers nothing
       (``request_finished`` returns ``None``): its proxy sends both legs at once with a ``transfer_id`` and the
       prefill side's bootstrap address (``remote_bootstrap_addr``, ``remote_engine_id``), a third handshake this
       module does not speak.
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

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
"""SGLang's PD fields. The legs a proxy builds carry only its own handshake's fields: a client's own
``kv_transfer_params`` or bootstrap fields (a remote prefill pointing at a server of its choosing) never reach a
worker, which would pull KV from wherever they point."""


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
        remote_block_ids: the prefill worker's block ids holding the prompt, in order: one list per KV cache group
            (vLLM 0.32, ``NixlPullScheduler.request_finished``'s ``block_ids``), or one flat list (the blocks of the
            first group, earlier versions). ``block_ids_by_group`` reads either.
        remote_host: where the prefill side serves the transfer (NIXL: ``VLLM_NIXL_SIDE_CHANNEL_HOST``; Mooncake:
            the worker's IP).
        remote_port: its port (NIXL: ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + data-parallel rank).
        remote_request_id: the prefill worker's own id of the request, which names the parked blocks
            (NIXL connector version 2).
        tp_size: the prefill engine's tensor-parallel size (NIXL ``request_finished``; read by
            ``NixlConnectorMetadata._add_new_req`` with a default of 1).
        dcp_size: the prefill engine's decode-context-parallel size (vLLM 0.32; read with a default of 1).
        pp_size: its pipeline-parallel size (vLLM 0.32).
        remote_num_tokens: prompt tokens whose KV the prefill worker computed and parked
            (``request.num_computed_tokens``; vLLM 0.32's decode side loads ``min(this, prompt tokens)``), or
            ``None`` where the connector does not say.
        remote_blocks_expiry_time: when the parked blocks are freed if nobody pulls them, the prefill worker's
            monotonic clock (vLLM 0.32 sets it only for blocks a decode worker parks for a next turn).
        transfer_mode: ``pull`` (the decode side reads: ``NixlPullScheduler``) or ``push``; the two are
            incompatible (``compute_nixl_compatibility_hash``).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int | list[int]] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str = "pull"

    def block_ids_by_group(self) -> list[list[int]]:
        """``remote_block_ids`` as one list per KV cache group (a flat list is the first group's).

        Raises:
            ValueError: a mix of ids and lists.
        """
        ids = self.remote_block_ids or []
        if all(isinstance(b, list) for b in ids):
            return [list(g) for g in ids if isinstance(g, list)]
        if any(isinstance(b, list) for b in ids):
            raise ValueError("remote_block_ids mixes block ids and per-group lists")
        return [[b for b in ids if isinstance(b, int)]]

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
        (``max_completion_tokens: 1`` when present), without ``stream_options``, ``min_tokens``,
        ``min_completion_tokens`` and the client's bootstrap fields (``BOOTSTRAP_FIELDS``).
    """
    out = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
    out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    for key in PREFILL_ONLY_FIELDS:
        out.pop(key, None)
    return out


def remote_prefill_cached_tokens(prefill_params: dict[str, Any] | None) -> int | None:
    """The prefill side's prefix-cache hits as its answer's ``kv_transfer_params`` carry them, or ``None``.

    vLLM 0.32's scheduler adds ``remote_prefill_cached_tokens`` (the prefill request's ``num_cached_tokens``) to the
    params of a finished prefill leg (``vllm/v1/core/sched/scheduler.py``, ``update_from_output``), and its decode
    worker reports that number as ``usage.prompt_tokens_details.cached_tokens`` instead of its own near-total hit
    from the transfer (``vllm/v1/engine/output_processor.py``, ``RequestState.from_new_request`` and
    ``_update_stats_from_output``): the decode leg's answer tells the client what the prefill side had cached.
    """
    if not prefill_params or not prefill_params.get("do_remote_prefill"):
        return None
    value = prefill_params.get("remote_prefill_cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def unusable_prefill_params(params: object) -> str | None:
    """Why a prefill answer's ``kv_transfer_params`` cannot go on a decode leg, or ``None`` when they can.

    Absent, ``null`` or empty params can (the decode leg goes without any and its worker computes the prompt); an
    object can when it decodes as ``KVTransferParams``, does not ask for a remote decode, and, asking for a remote
    prefill, names everything a decode worker pulls with (``KVTransferParams.is_complete_remote_prefill``) in one
    shape of ``remote_block_ids``: the checks the reference worker's ``workers.handoff.classify_leg`` makes, so a
    prefill worker's bad answer is its own failure, not a decode worker's 400 about a field the client never sent.
    """
    if params is None or params == {}:
        return None
    if not isinstance(params, dict):
        return f"a JSON {type(params).__name__}, not an object"
    try:
        parsed = msgspec.convert(params, KVTransferParams)
    except msgspec.ValidationError as exc:
        return str(exc)
    if parsed.do_remote_decode:
        return "do_remote_decode is set (the answer of a prefill leg sets do_remote_prefill)"
    if not parsed.do_remote_prefill:
        return None
    try:
        parsed.block_ids_by_group()
    except ValueError as exc:
        return str(exc)
    if not parsed.is_complete_remote_prefill:
        return (
            "do_remote_prefill needs remote_block_ids, remote_engine_id, remote_request_id, remote_host and "
            "remote_port"
        )
    return None


def decode_leg_body(body: dict[str, Any], prefill_params: dict[str, Any] | None) -> dict[str, Any]:
    """The vLLM decode leg (step 3): the client's body with the prefill answer's ``kv_transfer_params``.

    Args:
        body: the client's decoded JSON body, as received.
        prefill_params: the prefill response's ``kv_transfer_params`` (``None`` or empty: the body goes without
            any, and the decode worker computes the prompt itself; the client's own ``kv_transfer_params`` never
            reach the decode worker, which would pull KV from wherever they point).

    Returns:
        A new mapping without the client's bootstrap fields (``BOOTSTRAP_FIELDS``); ``body`` is not changed.
    """
    out = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
    if prefill_params:
        out["kv_transfer_params"] = prefill_params
    else:
        out.pop("kv_transfer_params", None)
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
    """The body both SGLang legs get: the client's, with the bootstrap fields of a single prompt added (the
    client's own replaced) and without the client's ``kv_transfer_params`` (``BOOTSTRAP_FIELDS``).

    Returns:
        A new mapping; ``body`` is not changed.
    """
    out = dict(body)
    out.pop("kv_transfer_params", None)
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
