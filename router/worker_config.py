"""The fleet's entries in the gateway's config: the served models (``models[]``) and the workers (``workers[]``).

Split from ``router.config`` so that the sections built on a worker entry (the admin API's ``POST /admin/workers``,
``discovery.worker``) decode it with exactly the YAML's rules without importing the whole tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from events.errors import EventsConfigError
from events.publisher import offset_endpoint
from events.types import Medium, normalize_medium
from router.config_base import AtLeastOne, ConfigStruct, PositiveFactor, PositiveSeconds, check_positive
from router.errors import ConfigError
from router.pd_config import PDConfig, Role

__all__ = [
    "MAX_DP_RANKS",
    "ModelConfig",
    "Topology",
    "WorkerConfig",
    "decode_worker",
    "worker_block_size_error",
]

MAX_DP_RANK = 65_535
"""Largest ``workers[].dp_rank_offset`` (a vLLM data-parallel rank)."""
MAX_DP_RANKS = 256
"""Most data-parallel ranks one worker may declare (``workers[].dp_ranks``). Each rank of a worker that publishes
events is one ZMQ subscription of the gateway (a SUB socket and its monitor: 3 sockets, 4 file descriptors); how
many one process can follow in all is ``events.capacity.rank_stream_capacity`` (the open-files limit, at 20,000
descriptors about 4,870): a start-up over it is refused naming the limit, a worker added later past it is refused
when it is added (nothing of it stays registered)."""



class ModelConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A model the fleet serves, and how the gateway tokenizes and hashes its prompts.

    Tokens must equal the worker's, so the gateway uses the worker's own tokenization module with the same
    settings: ``tokenizer_path`` (a ``tokenizer.json``) or the byte-level default, and ``chat_template``.

    Attributes:
        name: the OpenAI ``model`` name clients send.
        tokenizer_path: path to a ``tokenizer.json``; ``None`` for the byte-level default.
        chat_template: path to a Jinja chat template, or ``None`` for the tokenization module's default.
        block_size: tokens per block of the engine's prefix cache.
        lora_adapters: model names that select a LoRA adapter on this base model; a request naming one is
            hashed in that adapter's namespace (vLLM feeds the adapter name into its block hash).
        honor_cache_salt: hash a request's ``cache_salt`` field into its namespace (vLLM semantics).
        default_max_tokens: ``max_tokens`` assumed when a request sends none, in tokens.
        enable_pending_blocks: when a request goes to a worker that publishes events, insert its full prompt
            blocks into the index as pending entries for that worker (``PrefixIndex.insert_approximate``), so a
            request routed right behind it predicts what the worker will have cached by the time it schedules
            that request, before the worker's events arrive (``router.routing``, step 5).
        pending_blocks_ttl_s: seconds a pending block lives unless the worker's ``BlockStored`` confirms it
            (then it is the event's and stops expiring); cover the queueing plus prefill time of a request.
        max_routed_blocks: most blocks of one request that its routing decision inserts into the index for the
            chosen worker (pending entries, or the entries of a worker without events), the prompt's first ones:
            16,384 blocks are 262,144 tokens at 16 per block, past any model's context. A longer prompt's other
            blocks come from the worker's events (a worker without events is predicted that far). It bounds how
            long one huge prompt holds the event loop: inserting the 219K blocks of a 15 MB prompt took 1.8 s on a
            busy 2-core host (``python -m benchmarks huge_prompt``).
        prompt_cache_max_bytes: bytes the gateway's prompt caches of this model hold at most (estimated: block
            hashes, tail tokens and checkpoint text; ``router.request_view.ModelTokenizer``): chat prefix states,
            text checkpoints and whole-prompt states, least recently used evicted first. It holds the live sessions:
            what was used within ``prompt_cache_idle_s`` is kept up to this cap, so sessions taking turns do not
            evict each other's checkpoints; the default 1 GiB is the checkpoints of about 850 live text sessions of
            100K tokens (1.2 MiB each: the text, in 2 bytes a character once it holds one non-Latin-1 character, and
            6,250 block hashes) or 2,900 chats of that length (0.35 MiB: the hashes). Chat prefix states get half of
            it, text checkpoints three eighths, whole text prompts one eighth. A gateway of ``--processes N`` holds
            N such caches. They are dropped when the model's last worker is removed.
        prompt_cache_idle_max_bytes: bytes the prompt caches keep at most while their least recently used entry is
            idle (not used for ``prompt_cache_idle_s``): past it, idle entries go first, so the caches come back
            to this size as idle sessions' turns stop (on the next writes; an unused cache keeps what it holds).
            Of the default 64 MiB, chat prefix states get half: about 600,000 block hashes (a thousand
            9,600-token conversations at block size 16). Larger than ``prompt_cache_max_bytes``: the same as it.
        prompt_cache_idle_s: seconds after its last use that a cached prompt state or checkpoint is idle: cover the
            time a live session waits between turns (its tools, its user).
        pd: serve the model disaggregated (``router.pd_config``): each request gets a prefill leg on a worker of
            role ``prefill`` (or ``both``) and a decode leg on one of role ``decode`` (or ``both``); ``None``: every
            worker of the model serves whole requests.
    """

    name: str
    tokenizer_path: str | None = None
    chat_template: str | None = None
    block_size: AtLeastOne = 16
    lora_adapters: tuple[str, ...] = ()
    honor_cache_salt: bool = True
    default_max_tokens: AtLeastOne = 256
    enable_pending_blocks: bool = True
    pending_blocks_ttl_s: PositiveSeconds = 10.0
    max_routed_blocks: AtLeastOne = 16_384
    prompt_cache_max_bytes: AtLeastOne = 1 << 30
    prompt_cache_idle_max_bytes: AtLeastOne = 64 << 20
    prompt_cache_idle_s: PositiveSeconds = 300.0
    pd: PDConfig | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        check_positive("block_size", self.block_size)
        check_positive("default_max_tokens", self.default_max_tokens)
        check_positive("pending_blocks_ttl_s", self.pending_blocks_ttl_s)
        check_positive("max_routed_blocks", self.max_routed_blocks)
        check_positive("prompt_cache_max_bytes", self.prompt_cache_max_bytes)
        check_positive("prompt_cache_idle_max_bytes", self.prompt_cache_idle_max_bytes)
        check_positive("prompt_cache_idle_s", self.prompt_cache_idle_s)
        if self.tokenizer_path is not None and not Path(self.tokenizer_path).exists():
            raise ValueError(f"tokenizer_path {self.tokenizer_path!r} does not exist")


Topology = Literal["connect", "bind"]


class WorkerConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One worker (an engine process) behind the gateway.

    Attributes:
        id: unique worker id; in the ``bind`` topology it must equal the ``<worker>`` of the topic
            ``kv@<worker>@<model>`` the worker publishes with.
        url: OpenAI HTTP base URL, ``http(s)://host[:port]``, e.g. ``http://127.0.0.1:8001``; request paths
            (``/v1/completions``, ``health_path``...) are appended to it, so it takes no path, query or fragment (a
            trailing ``/`` is dropped).
        model: served model (one of ``models[].name``).
        events_endpoint: ZMQ PUB endpoint the gateway connects to (``connect`` topology), e.g.
            ``tcp://127.0.0.1:5557``. ``None`` with the ``connect`` topology means the worker publishes no
            events: the gateway routes it in approximate mode.
        replay_endpoint: ZMQ ROUTER endpoint serving replays after a sequence gap, or ``None``.
        topology: ``connect`` (gateway SUB connects to the worker's PUB) or ``bind`` (the worker's PUB connects
            to ``events.bind_endpoint``).
        dp_ranks: number of data-parallel ranks publishing events, 1..``MAX_DP_RANKS``. Rank ``r`` publishes on the
            port of ``events_endpoint`` (and serves replays on the port of ``replay_endpoint``) plus ``r``, vLLM's
            convention; every rank's port must be at most 65535.
        dp_rank_offset: the data-parallel rank of the worker's first rank: its ranks are ``dp_rank_offset`` ..
            ``dp_rank_offset + dp_ranks - 1``, and a batch's ``data_parallel_rank`` outside them is dropped
            (``unknown_dp_rank``). For vLLM's external data parallelism (``--data-parallel-rank k`` on a server
            of its own), that server is a worker with ``dp_ranks: 1, dp_rank_offset: k``; vLLM offsets its
            publisher's port by its rank (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``), so its
            ``events_endpoint`` is the configured port plus ``k``. ``events_endpoint`` is always the first
            rank's address: rank ``dp_rank_offset + i`` publishes on its port plus ``i``.
        pools: shared pools (``MOONCAKE`` tier, or an engine's name for it) this worker is attached to; a worker's
            own tiers (``CPU``, ``DISK``) are refused.
        pool_event_media: media under which the worker's engine publishes its stores to the shared pool (vLLM's
            Mooncake store connector: ``CPU``); its events on them are applied as ``MOONCAKE`` (``router.pool_media``).
            Needs ``pools``; ``GPU`` is refused.
        block_size: the worker's block size in tokens, a multiple of its model's ``block_size``; ``None`` takes the
            model's.
        load_path: the worker's load endpoint (polled; returns load and start id), or ``None``.
        snapshot_path: endpoint returning the worker's cached blocks as KV events (warm-up), or ``None``.
        health_path: active health check path. The three paths are appended to ``url``, so each starts with ``/``.
        time_scale: wall seconds per second of the worker's own clock, for a simulated worker run with
            ``kvgate worker --time-scale X`` (1 for real engines). The TTFT the gateway observes (wall time) is
            divided by it before it calibrates the cost model, whose constants are in the worker's seconds.
        role: ``prefill``, ``decode`` or ``both`` (``router.pd_config``): which legs of a disaggregated model's
            requests it serves.
        bootstrap_port: SGLang's bootstrap port of a prefill worker (``--disaggregation-bootstrap-port``, SGLang's
            default 8998), sent as ``bootstrap_port``; ``None``: the port of ``url`` (the reference worker serves its
            pulls there).
    """

    id: str
    url: str
    model: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    topology: Topology = "connect"
    dp_ranks: int = 1
    dp_rank_offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    pools: tuple[str, ...] = ()
    pool_event_media: tuple[str, ...] = ()
    block_size: AtLeastOne | None = None
    load_path: str | None = "/load"
    snapshot_path: str | None = "/kv/snapshot"
    health_path: str = "/health"
    time_scale: PositiveFactor = 1.0
    role: Role = "both"
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None

    def __post_init__(self) -> None:
        check_positive("time_scale", self.time_scale)
        if self.bootstrap_port is not None and not 1 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port must be in 1..65535, got {self.bootstrap_port}")
        if not self.id:
            raise ValueError("id must not be empty")
        msgspec.structs.force_setattr(self, "url", _base_url(self.url))
        if not 1 <= self.dp_ranks <= MAX_DP_RANKS:
            raise ValueError(f"dp_ranks must be in 1..{MAX_DP_RANKS}, got {self.dp_ranks}")
        if not 0 <= self.dp_rank_offset <= MAX_DP_RANK:
            raise ValueError(f"dp_rank_offset must be in 0..{MAX_DP_RANK}, got {self.dp_rank_offset}")
        if self.topology == "connect":  # the bind topology has no per-worker events endpoint
            _check_rank_ports("events_endpoint", self.events_endpoint, self.dp_ranks)
        _check_rank_ports("replay_endpoint", self.replay_endpoint, self.dp_ranks)
        if self.block_size is not None:
            check_positive("block_size", self.block_size)
        for pool in self.pools:
            if normalize_medium(pool) is not Medium.MOONCAKE:  # a worker's own tiers are never shared
                raise ValueError(f"pools: {pool!r} is not a shared pool tier; the shared tier is MOONCAKE (also "
                                 f"named EXTERNAL, STORAGE or L3)")
        for name in self.pool_event_media:
            medium = normalize_medium(name)
            if medium is None or medium is Medium.GPU:
                raise ValueError(f"pool_event_media: {name!r} is not a medium an engine publishes pool stores under")
        if self.pool_event_media and not self.pools:
            raise ValueError("pool_event_media needs pools: the worker's pool stores go to a shared pool it is in")
        for name, path in (("load_path", self.load_path), ("snapshot_path", self.snapshot_path),
                           ("health_path", self.health_path)):
            if path is not None and not path.startswith("/"):  # appended to url, which has no trailing "/"
                raise ValueError(f"{name} must start with '/', got {path!r}")

    @property
    def dp_rank_range(self) -> range:
        """The worker's data-parallel ranks (``dp_rank_offset`` .. ``dp_rank_offset + dp_ranks - 1``)."""
        return range(self.dp_rank_offset, self.dp_rank_offset + self.dp_ranks)

    @property
    def has_events(self) -> bool:
        """Whether the worker publishes KV events the gateway can read."""
        return self.topology == "bind" or self.events_endpoint is not None


def _base_url(url: str) -> str:
    """``url`` checked as a worker's base URL (``http(s)://host[:port]``), without a trailing ``/``.

    Raises:
        ValueError: another scheme, no host, a bad port, or a path, query or fragment (the message names ``url``).
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parsing the port raises ValueError for a non-numeric one)
    except ValueError as exc:
        raise ValueError(f"url {url!r} does not parse: {exc}") from exc
    if not parts.hostname:
        raise ValueError(f"url {url!r} names no host")
    if parts.path not in ("", "/") or "?" in url or "#" in url:
        raise ValueError(f"url must be a base URL, http(s)://host[:port], without a path, query or fragment "
                         f"(request paths such as /v1/completions are appended to it), got {url!r}")
    return url.removesuffix("/")


def _check_rank_ports(name: str, endpoint: str | None, dp_ranks: int) -> None:
    """Refuse an endpoint that the last data-parallel rank cannot use.

    Rank ``r`` uses ``events.publisher.offset_endpoint(endpoint, r)`` (vLLM's data-parallel convention: the port
    plus ``r``, or a ``_dp<r>`` suffix for ``ipc://`` and ``inproc://``); ``tcp://host:*`` is used as is by every
    rank.

    Raises:
        ValueError: naming the key, the endpoint and why (e.g. the last rank's port over 65535).
    """
    try:
        offset_endpoint(endpoint, dp_ranks - 1)
    except EventsConfigError as exc:
        raise ValueError(f"{name} {endpoint!r} with dp_ranks {dp_ranks}: {exc}") from exc


def worker_block_size_error(worker: WorkerConfig, model: ModelConfig) -> str | None:
    """Why ``worker`` cannot serve ``model`` with its block size, or ``None`` when it can.

    The model's prefix index hashes blocks of the model's ``block_size``; a worker's block events are split into
    whole index blocks, so a worker's ``block_size`` must be a multiple of it (else every event is refused).
    """
    if worker.block_size is None or worker.block_size % model.block_size == 0:
        return None
    return (f"block_size {worker.block_size} is not a multiple of the block_size {model.block_size} of its model "
            f"{model.name!r} (models[].block_size): its events could not be indexed")


def decode_worker(obj: object) -> WorkerConfig:
    """Decode one worker (admin API payload) with the same rules as the YAML.

    Raises:
        ConfigError: naming the bad key and the reason.
    """
    try:
        return msgspec.convert(obj, WorkerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"worker: {exc}") from exc
