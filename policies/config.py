"""Policy configuration: frozen msgspec structs, one per policy, as a tagged union keyed by ``name``.

The gateway's YAML holds the policy as a mapping whose ``name`` picks the struct::

    policy:
      name: session_sticky
      max_extra_ttft_s: 0.5
      inner:
        name: cache_aware
        temperature: 0.0
        max_kv_usage: 0.97

Keys are **snake_case**, exactly the Python field names (no renaming), so the YAML, the admin REST payloads and
the code read the same. Unknown keys are refused (``forbid_unknown_fields``); every range is declared with
``msgspec.Meta`` and checked on decode. ``decode_policy_config`` turns any bad value into a
``PolicyConfigError`` whose ``key`` is the dotted path of the offending key (used by the YAML loader and by the
admin's hot reload, which keeps the old policy on error).

Calibrated defaults of ``cache_aware`` (Llama-3-8B, bf16, one H200; see ``policies/cost_model.py``):

    prefill of n tokens from scratch  t(n) = n / 40_000 + n**2 / 2.435e9   s     t(32_768) = 1.26 s
    KV bytes per token                2 (K,V) x 32 layers x 8 kv heads x 128 dims x 2 B = 131_072 B
    host (CPU) -> GPU restore         55e9 B/s over PCIe 5 (32_768 tokens: 4 GiB in 78 ms)
    shared pool (MOONCAKE) restore    12.5e9 B/s (one 100 Gb/s RDMA NIC; an assumption, set it per fleet)
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from policies.errors import PolicyConfigError, UnknownPolicyError

__all__ = [
    "CacheAwareConfig",
    "ConsistentHashConfig",
    "InnerPolicyConfig",
    "KeySource",
    "LeastLoadedConfig",
    "PolicyConfig",
    "PowerOfTwoConfig",
    "RandomConfig",
    "RoundRobinConfig",
    "SessionStickyConfig",
    "decode_policy_config",
    "encode_policy_config",
]

Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1, description="seed of the policy's own RNG")]
PositiveRate = Annotated[float, msgspec.Meta(ge=1.0, le=1e18)]
"""A rate (tokens/s, tokens**2/s, bytes/s): from 1 to 1e18, so every estimate stays a finite number of seconds."""
NonNegativeSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]
"""A duration in seconds, at most a day."""


class _PolicyConfigBase(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="name"):
    """Common base: frozen, unknown keys refused, tagged by ``name``."""


class RoundRobinConfig(_PolicyConfigBase, frozen=True, tag="round_robin"):
    """``round_robin``: the next eligible worker in configuration order. No parameters."""


class RandomConfig(_PolicyConfigBase, frozen=True, tag="random"):
    """``random``: a uniformly random eligible worker.

    Attributes:
        seed: seed of the policy's RNG (decisions are reproducible for a given request sequence).
    """

    seed: Seed = 0


class LeastLoadedConfig(_PolicyConfigBase, frozen=True, tag="least_loaded"):
    """``least_loaded``: fewest running + waiting requests, then fewest pending prefill tokens. No parameters."""


class PowerOfTwoConfig(_PolicyConfigBase, frozen=True, tag="power_of_two"):
    """``power_of_two``: two distinct eligible workers at random, the less loaded one wins.

    Attributes:
        seed: seed of the policy's RNG.
    """

    seed: Seed = 0


class ConsistentHashConfig(_PolicyConfigBase, frozen=True, tag="consistent_hash"):
    """``consistent_hash``: the session key on a hash ring with virtual nodes; least_loaded without a key.

    Attributes:
        num_virtual_nodes: ring points per worker (more: smoother spread, bigger ring). SGLang uses 160.
    """

    num_virtual_nodes: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 160


class CacheAwareConfig(_PolicyConfigBase, frozen=True, tag="cache_aware"):
    """``cache_aware``: minimum estimated TTFT (seconds) over the eligible, non-saturated workers.

    The formula is in ``policies/cost_model.py``. Defaults are calibrated for Llama-3-8B on one H200.

    Attributes:
        prefill_linear_tokens_per_s: linear (GEMM) part of the prefill rate, tokens/s; also the rate at which
            queued prefill work ahead of the request drains.
        prefill_quadratic_tokens_sq_per_s: attention part of the prefill cost, tokens**2/s: prefilling positions
            c..n costs ``(n**2 - c**2) / this`` seconds on top of the linear part.
        per_waiting_request_s: scheduling delay added per request waiting at the worker, seconds.
        per_running_request_s: slowdown added per running (decoding) request sharing the batch, seconds.
        overhead_s: fixed per-request time (HTTP, tokenization, first decode step), seconds; not scaled by the
            online speed factor.
        kv_bytes_per_token: KV cache bytes per token (all layers, K and V), bytes.
        host_bandwidth_bytes_per_s: restore bandwidth from the worker's own CPU tier to its GPU, bytes/s.
        pool_bandwidth_bytes_per_s: restore bandwidth from the shared pool (MOONCAKE) to the GPU, bytes/s.
        recompute_penalty: weight of the prefill time of the tokens a worker lacks, added to its estimated TTFT
            for ranking (``policies/cache_aware.py``): 0 ranks by this request's TTFT alone; 1 also charges, once,
            the delay a recompute imposes on the requests queued behind it and the hit a moved conversation loses;
            the default 2 charges it twice (measured on the demo: greedy TTFT kept 0.75 of the reachable hits).
        decode_penalty: weight of the decode load term added to the ranking cost (``policies/cost_model.py``,
            ``decode_load_s``): the decode time that sharing the worker's batch adds, to this request and to the
            requests already running there, over ``decode_horizon_tokens`` steps. 0 turns it off (then requests
            sharing a long prefix, such as one system prompt, all go to the worker holding it however many
            sequences it already decodes).
        decode_horizon_tokens: decode steps the decode load is charged over: the request's ``max_tokens`` (or the
            model's default) when smaller.
        decode_s_per_sequence: time one more sequence adds to every decode step (sampling, scheduling), seconds.
        kv_read_bytes_per_s: GPU memory bandwidth at which a decode step reads each sequence's KV cache, bytes/s
            (H200: 4.8e12 nominal).
        temperature: 0 takes the minimum; above 0, scores are min-max normalized to [0, 1] and a worker is
            drawn with probability softmax(-normalized / temperature) from the seeded RNG.
        seed: seed of the softmax RNG.
        max_running_requests: a worker with at least this many running requests is saturated; ``None``: off.
        max_kv_usage: a worker whose GPU KV usage (0..1) is at least this is saturated; ``None``: off.
        max_pending_prefill_tokens: a worker with at least this many prompt tokens queued for prefill is
            saturated; ``None``: off. Saturated workers are excluded unless every eligible worker is saturated.
        enable_calibration: correct each worker's speed online from the TTFT it shows (``TTFTCalibrator``).
        calibration_alpha: EWMA weight of one observation (in log space), 0 < alpha <= 1.
        min_speed_factor: lower bound of the per-worker speed factor (1.0 = as profiled; 2.0 = twice slower).
        max_speed_factor: upper bound of the per-worker speed factor.
        min_calibration_work_s: observations whose predicted scalable time is shorter than this (seconds) carry
            too little signal and are ignored.
        max_num_batched_tokens: the workers' step budget, tokens (their scheduler's ``max_num_batched_tokens``,
            vLLM's flag of the same name); read only with ``long_prefill_token_threshold``.
        long_prefill_token_threshold: the workers' cap on one request's tokens per step (their scheduler's
            ``long_prefill_token_threshold``, vLLM's flag of the same name), tokens; 0: none. Below the budget, a
            request shares each step with the prefills queued ahead instead of waiting for all of them
            (``policies/cost_model.py``, ``shared_step_queue_s``). Set both to the workers' values.
    """

    prefill_linear_tokens_per_s: PositiveRate = 40_000.0
    prefill_quadratic_tokens_sq_per_s: PositiveRate = 2.435e9
    per_waiting_request_s: NonNegativeSeconds = 0.005
    per_running_request_s: NonNegativeSeconds = 0.001
    overhead_s: NonNegativeSeconds = 0.003
    kv_bytes_per_token: Annotated[int, msgspec.Meta(ge=1, le=2**40)] = 131_072
    host_bandwidth_bytes_per_s: PositiveRate = 55e9
    pool_bandwidth_bytes_per_s: PositiveRate = 12.5e9
    recompute_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 2.0
    decode_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    decode_horizon_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256
    decode_s_per_sequence: NonNegativeSeconds = 2.0e-5
    kv_read_bytes_per_s: PositiveRate = 4.0e12
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    seed: Seed = 0
    max_running_requests: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_kv_usage: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    max_pending_prefill_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    enable_calibration: bool = True
    calibration_alpha: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.25
    min_speed_factor: Annotated[float, msgspec.Meta(gt=0.0)] = 0.25
    max_speed_factor: Annotated[float, msgspec.Meta(gt=0.0)] = 8.0
    min_calibration_work_s: NonNegativeSeconds = 0.01
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.min_speed_factor > 1.0 or self.max_speed_factor < 1.0:
            raise ValueError("min_speed_factor: must be <= 1.0 <= max_speed_factor")


KeySource = Literal["x-session-id", "x-smg-routing-key", "user", "opening_blocks"]
"""Where a session key may come from: a request header (case-insensitive), the body's ``user``, or a hash of
the conversation's opening (system prompt and first user message) blocks."""

InnerPolicyConfig = (
    RoundRobinConfig | RandomConfig | LeastLoadedConfig | PowerOfTwoConfig | ConsistentHashConfig | CacheAwareConfig
)
"""Any policy a ``session_sticky`` policy may wrap (everything except ``session_sticky`` itself)."""


class SessionStickyConfig(_PolicyConfigBase, frozen=True, tag="session_sticky"):
    """``session_sticky``: keep a session on the worker that owns its state, wrapping any other policy.

    The owner loses the session when it is unhealthy, draining, missing, excluded by the inner policy (e.g.
    saturated), or, on cost, when the move pays for what it loses (``price_moves``: ``policies/move_cost.py``) and
    the owner is costlier than the inner policy's best by more than **every** configured margin (a margin set to
    ``None`` is not checked; with ``price_moves`` off and both margins ``None`` it never moves on cost). The cost
    rule and the margins apply only when the inner policy scores in seconds of TTFT (``cache_aware``).

    Idle expiry belongs to the session store, shared by every gateway replica: ``sessions.idle_timeout_s``.

    Attributes:
        inner: the wrapped policy (chooses new owners and scores the alternatives).
        key_sources: where the gateway looks for the session key, first match wins.
        price_moves: move on cost only when the owner's extra estimated TTFT exceeds the recompute of the prefix it
            holds and the alternative lacks, and (when that recompute is not zero) the owner's estimate is beyond
            the fleet's recent tail (``policies/move_cost.py``).
        move_tail_quantile: the quantile of the estimated TTFTs of the recent requests already served that is the
            fleet's tail for ``price_moves`` (0.99: their p99, as the benchmarks report it; 1.0: their maximum).
        move_tail_window: how many recent decisions that quantile is taken over.
        resident_idle_s: a session unseen this long no longer counts among its owner's resident prompts (the
            memory term of ``cache_aware``, ``policies/residents.py``), seconds.
        charge_returning_sessions: rank a new session's first request (inner ``cache_aware``) with the wait its
            prefill imposes on each worker's live sessions expected back during it, raising a worker's cost to the
            fleet's served tail at most (``move_tail_quantile``; no cap with ``price_moves`` off;
            ``policies/returning.py``).
        return_gap_window: how many recent gaps between a session's turns the fleet's expected gap is taken over.
        max_extra_ttft_s: the owner may be at most this many seconds costlier than the best alternative.
        max_ttft_ratio: the owner may be at most this many times costlier than the best alternative.
    """

    inner: InnerPolicyConfig = msgspec.field(default_factory=CacheAwareConfig)
    key_sources: tuple[KeySource, ...] = ("x-session-id", "x-smg-routing-key", "user", "opening_blocks")
    max_extra_ttft_s: NonNegativeSeconds | None = None
    max_ttft_ratio: Annotated[float, msgspec.Meta(ge=1.0)] | None = None
    price_moves: bool = True
    move_tail_quantile: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.99
    move_tail_window: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1024
    resident_idle_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0)] = 300.0
    charge_returning_sessions: bool = True
    return_gap_window: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256

    def __post_init__(self) -> None:
        if not self.key_sources:
            raise ValueError("key_sources: must name at least one source")
        if len(set(self.key_sources)) != len(self.key_sources):
            raise ValueError("key_sources: must not repeat a source")


PolicyConfig = InnerPolicyConfig | SessionStickyConfig
"""Any policy configuration; decode with ``decode_policy_config``."""

POLICY_NAMES: tuple[str, ...] = tuple(
    sorted(
        str(cls.__struct_config__.tag)
        for cls in (
            RoundRobinConfig,
            RandomConfig,
            LeastLoadedConfig,
            PowerOfTwoConfig,
            ConsistentHashConfig,
            CacheAwareConfig,
            SessionStickyConfig,
        )
    )
)
"""Every policy name, sorted."""

_AT_PATH = re.compile(r"^(?P<reason>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_BAD_TAG = re.compile(r"^Invalid value (?P<value>.+)$")
_FIELD_REASON = re.compile(r"^(?P<field>[a-z_]+): (?P<reason>.+)$", re.DOTALL)
"""``__post_init__`` checks raise ``ValueError("<field>: <reason>")`` so the error can name the key."""


_MOVED_KEYS = {"idle_timeout_s": "sessions.idle_timeout_s (session expiry is the session store's, shared by replicas)"}
"""Policy keys that belong to another section of the gateway's config: their error says where."""


def _dotted(path: str) -> str:
    """``.inner.key_sources[1]`` -> ``inner.key_sources[1]``."""
    return path[1:] if path.startswith(".") else path


def decode_policy_config(obj: object) -> PolicyConfig:
    """Decode a policy configuration from YAML/JSON builtins or raw JSON.

    Args:
        obj: a mapping as produced by ``yaml.safe_load`` (or ``json.loads``), or JSON text as ``str``/``bytes``
            (the admin's ``PUT /admin/policy`` body).

    Returns:
        The frozen config struct selected by ``name``.

    Raises:
        UnknownPolicyError: ``name`` (or ``inner.name``) names no policy (``session_sticky`` cannot be inner).
        PolicyConfigError: anything else: a missing ``name``, an unknown key, a wrong type, a value out of
            range, or invalid JSON. ``key`` is the dotted path of the offending key.
    """
    try:
        config: PolicyConfig
        if isinstance(obj, str | bytes | bytearray | memoryview):
            config = msgspec.json.decode(obj, type=PolicyConfig)
        else:
            config = msgspec.convert(obj, PolicyConfig)
        return config
    except msgspec.ValidationError as exc:
        raise _translate(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise PolicyConfigError("", f"invalid JSON: {exc}") from exc


def _translate(message: str) -> PolicyConfigError:
    """Turn a msgspec validation message into a ``PolicyConfigError`` naming the key."""
    match = _AT_PATH.match(message)
    reason = match.group("reason") if match else message
    key = _dotted(match.group("path") or "") if match else ""
    bad_tag = _BAD_TAG.match(reason)
    if bad_tag is not None and (key == "name" or key.endswith(".name")):
        if key == "name":
            return UnknownPolicyError(key, _unquote(bad_tag.group("value")), POLICY_NAMES)
        inner_names = tuple(n for n in POLICY_NAMES if n != "session_sticky")
        return UnknownPolicyError(key, _unquote(bad_tag.group("value")), inner_names)
    unknown = re.match(r"^Object contains unknown field `(?P<field>[^`]+)`$", reason)
    if unknown is not None:
        field = unknown.group("field")
        moved = _MOVED_KEYS.get(field)
        return PolicyConfigError(f"{key}.{field}" if key else field,
                                 "unknown key" if moved is None else f"unknown key; set {moved} instead")
    missing = re.match(r"^Object missing required field `(?P<field>[^`]+)`$", reason)
    if missing is not None:
        field = missing.group("field")
        return PolicyConfigError(f"{key}.{field}" if key else field, "required key is missing")
    field_error = _FIELD_REASON.match(reason)
    if field_error is not None:
        field = field_error.group("field")
        return PolicyConfigError(f"{key}.{field}" if key else field, field_error.group("reason"))
    return PolicyConfigError(key, reason)


def _unquote(value: str) -> str:
    """``'foo'`` -> ``foo`` (msgspec quotes string tag values)."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def encode_policy_config(config: PolicyConfig) -> dict[str, object]:
    """Config struct -> YAML/JSON-ready mapping (every field, ``name`` first); ``decode_policy_config`` inverts it."""
    out = msgspec.to_builtins(config)
    if not isinstance(out, dict):  # pragma: no cover - structs always encode to dicts
        raise RuntimeError("policy config did not encode to a mapping")
    return out
