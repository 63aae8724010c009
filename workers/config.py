"""Typed, frozen configuration of the reference worker, loaded once from CLI flags and/or a YAML profile.

A YAML profile uses the kebab-case keys below, grouped as the struct tree::

    worker-id: w0
    model: llama-3-8b-sim
    port: 8100
    kv-events-endpoint: "tcp://*:5557"
    kv-cache: {num-gpu-blocks: 4096, num-cpu-blocks: 16384, block-size: 16, cpu-store-policy: all,
               pool: {backend: mooncake, master-address: "127.0.0.1:50051", store-policy: all}}
               # or pool: {backend: sim, name: fleet-a, capacity-blocks: 65536}
    scheduler: {max-num-seqs: 256, max-num-batched-tokens: 8192, max-model-len: 131072,
                long-prefill-token-threshold: 0}
    timing: {prefill-s-per-token: 2.38e-5, host-to-gpu-bytes-per-s: 55.0e9, ...}
    time-scale: 1.0
    role: both                   # prefill | decode | both
    kv-transfer: {abort-request-timeout-s: 480, pull-timeout-s: 30}

CLI flags given explicitly override the profile (``workers.cli``); any ``--pool-*`` or ``--mooncake-*`` flag creates
the ``kv-cache.pool`` section (backend ``sim`` unless ``--pool-backend`` says otherwise). The ``torch`` engine
refuses a pool section (``WorkerConfig.__post_init__``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from common.yaml_load import safe_load_yaml
from workers.errors import ConfigError

Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
MOONCAKE_DEFAULT_LEASE_TTL_S = 10.0
"""A ``mooncake_master``'s lease when its ``--default_kv_lease_ttl`` is not given
(``DEFINE_uint64(default_kv_lease_ttl, mooncake::DEFAULT_DEFAULT_KV_LEASE_TTL, ...)``,
``mooncake-store/src/master.cpp``; ``DEFAULT_DEFAULT_KV_LEASE_TTL`` = 10,000 ms, ``mooncake-store/include/types.h``)."""
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """The shared pool tier (``workers.kv.pool_tier``), below the CPU tier."""

    backend: Literal["sim", "mooncake"] = "sim"
    """``sim``: an in-process pool shared by the workers of this process that name it; ``mooncake``: a Mooncake
    Store client (optional extra ``mooncake``)."""
    name: str = "default"
    """Sim pool name: workers of one process naming the same pool share it."""
    capacity_blocks: Positive = 65536
    """Sim pool size in blocks (LRU beyond it)."""
    store_policy: Literal["all", "prompt_only", "none"] = "all"
    """Which newly cached GPU blocks are written through to the pool."""
    master_address: str = "127.0.0.1:50051"
    """Mooncake master RPC address."""
    metadata_server: str = "P2PHANDSHAKE"
    """Mooncake metadata server (``http://127.0.0.1:8080/metadata``, or ``P2PHANDSHAKE`` for none)."""
    local_hostname: str = "127.0.0.1"
    """This client's address for Mooncake transfers."""
    global_segment_size: NonNegative = 256 << 20
    """Bytes this worker contributes to the pool (0: a pure client)."""
    local_buffer_size: NonNegative = 64 << 20
    """Mooncake client transfer buffer (at least one block's value)."""
    protocol: str = "tcp"
    """Mooncake transport."""
    value_bytes_per_block: NonNegative = 0
    """Size of a block's value in the pool, bytes: the sim engine's token ids (4 bytes each) padded with zeros to
    this size, so a pool of a given byte size holds as many blocks as a real engine's would (0: the token ids
    only)."""
    num_layer_groups: Annotated[int, msgspec.Meta(ge=1, le=255)] = 1
    """Pieces of a block's value, one per layer group (a pipeline stage's layers): all of them go into one pool
    object with a manifest (``workers.kv.pool_chunk``), so the pool keeps or evicts the whole block and a
    restore never loads part of one."""
    io: Literal["threads", "inline"] = "threads"
    """Where a Mooncake store's reads and puts run: ``threads``: on two background threads, so the engine keeps
    stepping the other sequences while a restore's bytes arrive (``workers.kv.pool_tier``); ``inline``: inside
    the engine step (every sequence waits). The sim backend always runs inline (no real I/O)."""
    read_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    """Restore reads in flight at once with ``io: threads`` (a read's time is mostly Mooncake's per-object round
    trips to the segments' owners, so reads of several requests can overlap where cores are free). On a loaded
    2-core host 4 made each read 3.0 s of wall time instead of 0.8 s at 64 sessions of the agentic demo (the
    workers' threads fight for the cores) and cut the shared pool's reuse to 0.73 of the ceiling: 1 by default."""
    blocks_per_span: Annotated[int, msgspec.Meta(ge=1, le=64)] = 16
    """Blocks per pool object along a chain (``common.pool_keys``): positions ``k·L .. k·L + L-1`` of a chain
    go into one object keyed by its last block's hash (a chain's unfinished tail, fewer than ``L`` blocks, one
    object per block), because Mooncake's cost per object dominates its batch calls (558 blocks of 889 bytes:
    about 10 µs per object per put and 5 µs per read, against 0.4 and 0.2 µs per block as one object). 1: one
    object per block. Workers sharing a pool must use the same value (a span is found only under its own length):
    the first worker to attach records it in the pool (``workers.kv.pool_layout``) and a worker with another
    value refuses to start (``PoolLayoutError`` naming both lengths)."""
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = MOONCAKE_DEFAULT_LEASE_TTL_S
    """The Mooncake master's lease, seconds (its ``--default_kv_lease_ttl`` flag, in milliseconds there): after the
    pool refused a put of this worker, it makes no refresh of its GPU and CPU hits for this long, so the leases
    granted before the refusal run out and the master has objects to evict (``workers.kv.pool_use``). Set it to
    the master's flag; the default is the master's default."""
    verify: Literal["all_bytes", "manifest"] = "all_bytes"
    """What a restore checks of each chunk it reads: ``all_bytes``: the manifest, each layer group's payload
    against its digest and the tokens expected, and the zero padding (every byte); ``manifest``: all but the
    padding (which only the sim engine's padded values have), at about the raw client's read speed."""


class CacheGroupConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """One KV-cache group of a hybrid model (``workers.kv.hybrid``); its position in ``kv-cache.groups`` is its
    ``group_idx`` on the wire. Group 0 is always full attention (the main block pool)."""

    kind: Literal["full", "sliding_window", "recurrent"] = "full"
    """``full``: every block kept; ``sliding_window``: blocks older than the window are freed; ``recurrent``: a
    fixed-size state per sequence (Mamba, linear attention), kept across requests only as checkpoints."""
    sliding_window_tokens: Positive | None = None
    """Window in tokens (``sliding_window`` only, required there)."""
    num_gpu_blocks: Positive | None = None
    """Blocks of this group's pool (``sliding_window``); ``None``: as many as the main pool."""
    state_bytes: NonNegative = 0
    """Bytes of one sequence's recurrent state, all layers (``recurrent``): what a checkpoint copies."""

    def __post_init__(self) -> None:
        if self.kind == "sliding_window" and self.sliding_window_tokens is None:
            raise ValueError("a sliding_window group needs sliding-window-tokens")
        if self.kind != "sliding_window" and self.sliding_window_tokens is not None:
            raise ValueError(f"sliding-window-tokens is for sliding_window groups, not {self.kind}")


class CheckpointConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """When recurrent-state checkpoints are taken and how many are kept (``workers.kv.hybrid``)."""

    interval_tokens: NonNegative = 4096
    """A checkpoint every this many tokens of a sequence (a multiple of the block size; 0: none by interval)."""
    at_prompt_end: bool = True
    """Also at the last block boundary of each prompt."""
    at_generation_end: bool = True
    """Also at the last block boundary a finished request computed (so the next turn resumes after its
    generated tokens)."""
    max_checkpoints: Positive = 1024
    """Checkpoints kept in GPU memory per recurrent group (least recently used evicted beyond it)."""
    num_cpu_checkpoints: NonNegative = 0
    """Checkpoints kept in host memory per recurrent group (written through; 0: no CPU tier for them)."""


class KVCacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """The KV manager's pools."""

    num_gpu_blocks: Positive = 4096
    """GPU blocks in the pool."""
    num_cpu_blocks: NonNegative = 0
    """CPU tier blocks; 0 disables the tier."""
    block_size: Positive = 16
    """Tokens per block."""
    cpu_store_policy: Literal["all", "prompt_only", "none"] = "all"
    """Which newly cached GPU blocks are written through to CPU: every one, prompt blocks only, or none."""
    pool: PoolConfig | None = None
    """The shared pool tier (``None``: none)."""
    groups: tuple[CacheGroupConfig, ...] = ()
    """KV-cache groups of a hybrid model, by ``group_idx``; empty: one full-attention group (group 0)."""
    checkpoints: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Recurrent-state checkpoints (used when a group is ``recurrent``)."""

    def __post_init__(self) -> None:
        if self.groups and self.groups[0].kind != "full":
            raise ValueError("kv-cache.groups[0] must be the full-attention group (kind: full)")
        if any(g.kind == "full" for g in self.groups[1:]):
            raise ValueError("only kv-cache.groups[0] may be a full-attention group")
        interval = self.checkpoints.interval_tokens
        if interval % self.block_size:
            raise ValueError(
                f"checkpoints.interval-tokens {interval} is not a multiple of block-size {self.block_size}"
            )


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Continuous batching limits."""

    max_num_seqs: Positive = 256
    """Sequences running (or restoring) at once."""
    max_num_batched_tokens: Positive = 8192
    """Tokens computed per step (prefill chunks + decodes)."""
    max_model_len: Positive = 131072
    """Prompt plus output tokens per request."""
    default_max_tokens: Positive = 256
    """``max_tokens`` when a request gives none (capped by the context left)."""
    long_prefill_token_threshold: NonNegative = 0
    """Tokens one request may compute in one step at most, before the step budget caps it (0: no cap, only the
    budget). vLLM's field of the same name (``vllm/config/scheduler.py``, ``SchedulerConfig``; default 0), as its
    V1 scheduler applies it (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``): a running or waiting
    request's new tokens are cut to the threshold when it is above 0 and below them, then to the budget left, so a
    long prefill leaves ``max_num_batched_tokens - threshold`` tokens of each step to the requests behind it. vLLM
    sets it to 4 % of ``max_model_len`` when left at 0 only when ``max_num_partial_prefills`` is above 1, which its
    V1 engine refuses; neither partial-prefill limit exists here (no V1 scheduler reads them). Measured with
    ``benchmarks/routing.py`` (4 sim workers, budget 8,192, the gateway told the same cap): on the Mooncake slice at
    1,800 s the default policy kept 0.997 of the ceiling with no priced move at 5,242 or 7,168 (0.966 and 0-5 moves
    a run off), its TTFT p90 went from 2.69 to 2.38 / 2.35 s and its p99 from 10.50 to 10.74 / 10.56 s (the long
    cold turns share their steps with the short ones); 0 by default until the p99 cost is settled."""
    hold_prefix_on_arrival: bool = True
    """Hold a request's GPU prefix hit from its arrival to its admission (a reference on each block, so that the
    allocations of the requests ahead cannot evict it while it waits), as a router that predicted the hit expects.
    vLLM looks the prefix up only at admission (a waiting request can lose it); ``False`` behaves that way."""


class TimingProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """The sim engine's timing model (``workers.engines.sim``); defaults: Llama-3-8B shape, one H200.

    Calibration: a 32,768-token prefill from empty takes
    ``step_overhead_s + 32768 * prefill_s_per_token + attention_s_per_token_pair * 32768**2 / 2``
    = 0.006 + 0.7758 + 0.4789 = 1.2607 s (measured on an H200: about 1.26 s). Host<->GPU copies at 55 GB/s with
    128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes): 32K tokens reload in 78 ms.
    """

    step_overhead_s: NonNegativeFloat = 0.006
    """Fixed cost of any step (weights read once, launch overheads)."""
    prefill_s_per_token: NonNegativeFloat = 2.3676e-5
    """Linear (GEMM) cost per computed token."""
    attention_s_per_token_pair: NonNegativeFloat = 8.92e-10
    """Attention cost per (query token, key token) pair computed in a prefill chunk."""
    decode_s_per_seq: NonNegativeFloat = 2.0e-5
    """Extra cost per decoding sequence in a step."""
    kv_read_bytes_per_s: PositiveFloat = 4.0e12
    """HBM bandwidth for reading KV during decode."""
    kv_bytes_per_token: Positive = 131072
    """KV cache size per token (all layers, K and V)."""
    host_to_gpu_bytes_per_s: PositiveFloat = 55.0e9
    """CPU -> GPU copy bandwidth (restores)."""
    gpu_to_host_bytes_per_s: PositiveFloat = 55.0e9
    """GPU -> CPU copy bandwidth (stores)."""
    copy_latency_s: NonNegativeFloat = 2.0e-5
    """Fixed latency per copy job."""
    pool_bytes_per_s: PositiveFloat = 20.0e9
    """Shared pool <-> GPU bandwidth, each direction (stores and restores; RDMA-class network)."""
    pool_latency_s: NonNegativeFloat = 1.0e-4
    """Fixed latency per pool copy job."""
    kv_link_bytes_per_s: PositiveFloat = 25.0e9
    """Worker-to-worker KV transfer bandwidth (prefill -> decode; a 200 Gb/s RDMA NIC): a pull of ``n`` blocks
    lasts ``kv_transfer_latency_s + n * block_size * kv_bytes_per_token / kv_link_bytes_per_s``, one pull at a time
    per decode worker (``workers.handoff``)."""
    kv_transfer_latency_s: NonNegativeFloat = 5.0e-4
    """Fixed cost per worker-to-worker transfer (handshake, descriptor exchange, completion notification)."""
    eos_probability: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Chance per sampled token that it is EOS (0: outputs run to ``max_tokens``)."""
    seed: int = 0
    """Seed of the sampled tokens when a request gives none."""


class KVTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Prefill/decode handoff (``workers.handoff``; the protocols are in ``common.pd_protocol``)."""

    engine_id: str | None = None
    """This worker's engine id in ``kv_transfer_params.remote_engine_id`` (``None``: the worker id)."""
    advertise_host: str | None = None
    """Host the decode side pulls from (``remote_host``; ``None``: the HTTP listen host)."""
    abort_request_timeout_s: PositiveFloat = 480.0
    """Prefill side: how long parked blocks wait for a pull before they are freed (vLLM's
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` default)."""
    pull_timeout_s: PositiveFloat = 30.0
    """Decode side: the longest a pull may take, waiting for the prefill leg included (SGLang flow)."""
    max_pending_rooms: Positive = 1024
    """Prefill side: pulls waiting at once for a bootstrap room whose prefill has not finished (SGLang flow)."""
    receive_wait_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 60.0
    """Decode side: how long a decode leg waits for a sequence slot and free KV blocks before it is refused (503
    ``kv_transfer_refused``), seconds, at most an hour; 0 refuses at once. Both engines queue such a request rather
    than refuse it: vLLM's scheduler keeps a remote-prefill request waiting until its blocks can be allocated
    (``vllm/v1/core/sched/scheduler.py``, ``WAITING_FOR_REMOTE_KVS``), SGLang's decode side holds it in its
    pre-allocation queue (``python/sglang/srt/disaggregation/decode.py``, ``DecodePreallocQueue``)."""


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Everything a worker process needs."""

    worker_id: str = "worker-0"
    """Name of the worker in events and metrics."""
    model: str = "kvgate-sim"
    """Model name served (``/v1/models``); requests for another model get a 404."""
    host: str = "127.0.0.1"
    """HTTP listen address."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    """HTTP port (0: ephemeral)."""
    engine: Literal["sim", "torch"] = "sim"
    """Which engine executes steps."""
    role: Literal["prefill", "decode", "both"] = "both"
    """Disaggregated serving role: ``prefill`` serves prefill legs (and keeps their KV for a decode worker),
    ``decode`` pulls a prefill worker's KV and decodes, ``both`` does either (vLLM's ``kv_both``); every role
    serves plain requests. SGLang's bootstrap fields name no leg, so they need ``prefill`` or ``decode``."""
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint for KV events (``tcp://*:5557``); ``None``: no publishing."""
    replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint answering replay requests."""
    kv_events_topic: str = ""
    """Topic frame of published batches."""
    tokenizer: str | None = None
    """``tokenizer.json`` or a directory with it; ``None``: the byte tokenizer."""
    time_scale: NonNegativeFloat = 1.0
    """Wall seconds slept per simulated second (1: real time, 0.1: ten times faster, 0: no sleeping)."""
    kv_cache: KVCacheConfig = msgspec.field(default_factory=KVCacheConfig)
    """KV pools."""
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    """Batching limits."""
    timing: TimingProfile = msgspec.field(default_factory=TimingProfile)
    """Sim engine timing."""
    enable_fault_injection: bool = False
    """Serve ``/debug/faults`` (``workers.faults``): delays, aborted answers, dropped events on demand. Test
    fleets only."""
    kv_transfer: KVTransferConfig = msgspec.field(default_factory=KVTransferConfig)
    """Prefill/decode handoff."""

    def __post_init__(self) -> None:
        """Refuse combinations no engine runs.

        Raises:
            ValueError: the ``torch`` engine with a shared pool tier (its pool copies are sim-engine only) or with
                hybrid cache groups. Why groups are refused there: the paged-attention kernels
                (``kernels/paged_prefill.py``, ``kernels/paged_decode.py``) would take a window cheaply in
                themselves (start the prefill's unmasked key loop and the decode split at ``query_pos - W + 1``, and
                AND ``key_pos > query_pos - W`` into the score mask of the band under a ``tl.constexpr`` switch),
                but the online softmax in ``attend_tile`` (``kernels/paged_tiles.py``) assumes every row sees a key
                in its first tile (``exp2(m_i - m_new)`` is NaN for a row masked out while ``m_i`` is still
                ``-inf``), so it needs a guarded maximum first. The engine side is
                the larger part and is not there: ``PrefillChunk`` / ``DecodeSeq`` carry one block table per sequence
                (group 0's), while a window group's blocks come from its own pool (``SlidingWindowGroup`` tables in
                the KV manager), and the torch model has one layer kind over one KV cache tensor; a recurrent group
                needs a state tensor per sequence and checkpoint copies. Until the step carries per-group tables and
                the model has windowed layers, the sim engine is the one that runs hybrid profiles.
        """
        if self.engine == "torch" and self.kv_cache.groups:
            raise ValueError(
                "the torch engine runs a full-attention model only: remove kv-cache.groups or use --engine sim"
            )
        if self.engine == "torch" and self.kv_cache.pool is not None:
            raise ValueError(
                "the torch engine does not run shared pool copies: remove kv-cache.pool (the --pool-* and "
                "--mooncake-* flags) or use --engine sim"
            )


def load_profile(path: str | Path) -> dict[str, object]:
    """Read a YAML profile into a plain mapping (validated later by ``build_config``).

    Raises:
        ConfigError: unreadable file or not a mapping.
    """
    try:
        data = safe_load_yaml(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read profile {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path} must be a mapping")
    return data


def build_config(raw: dict[str, object]) -> WorkerConfig:
    """Validate a kebab-case mapping into a ``WorkerConfig``.

    Raises:
        ConfigError: an unknown key or a bad value; the message names the key path (e.g. ``$.kv-cache.block-size``).
    """
    try:
        return msgspec.convert(raw, WorkerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid worker config: {exc}") from exc
