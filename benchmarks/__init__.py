"""Benchmarks of kvgate's parts, each figure printed beside a baseline measured in the same run.

Run from a checkout's root (this package is not part of the wheel): ``python -m benchmarks.NAME [flags]``, or
``python -m benchmarks NAME [flags]``; ``python -m benchmarks`` lists the names. Each module's docstring gives its
method and ``--help`` its flags.

==========  ==================================================================================================
name        measures
==========  ==================================================================================================
events      KV event decode + normalize (``events.decode``) vs plain ``msgspec.msgpack.decode``
index       prefix index ingest / match / hashing / bytes per entry (``router.index``) vs a node-per-block tree
policies    decision time per routing policy (``policies``) vs ``min()`` over the workers
gateway     gateway CPU and added latency per proxied request (``kvgate serve``) vs a bare aiohttp proxy
long_turns  gateway CPU, added latency and event-loop lag for 32K-200K-token turns vs bare proxy, Rust routers
huge_prompt small requests' p50/p99 and the event loop's max lag while one 15 MB prompt is routed vs without it
processes   requests/s and CPU per request of ``kvgate serve --processes N`` at N = 1, 2, 4, 8
fleet_scale Mooncake trace replayed into 1,000 workers (Dynamo's method); decision time at 8-1,000 workers
sessions    latency the session store adds (``router.sessions``), Redis vs in-memory
worker      reference worker scheduler + KV manager CPU per step, CPU tier on / off (``workers``)
routing     kvgate's policies beside sglang-router and vllm-router on one sim fleet: hit ÷ ceiling, TTFT, balance
kernels     GPU kernels (``kernels``) vs copy / pinned bandwidth and torch SDPA (``gpu`` extra; kernels_h200.md)
hybrid      recurrent-state checkpoints (``workers.kv.hybrid``): zero-reuse throughput and resumed-session TTFT vs off
pd          gateway CPU per disaggregated request (two legs, ``router.pd``) vs the aggregated path, same run
handoff     prefill -> decode KV handoff, gathered (``workers.model.kv_handoff``) vs per-block copies and copy ceilings
soak        RSS, descriptors, tasks, index entries of the gateway and sim workers over an hour of trace with churn
chaos       a trace replay on two gateway replicas sharing Redis while workers, Redis and a replica fail
pool        pool tier store/restore through the worker vs raw Mooncake batch calls; restored vs recomputed TTFT
pool_churn  churn on a real mooncake_master that evicts and restarts: stale pool predictions, byte checks
api_fuzz    schemathesis against a live gateway over sim workers: case counts and findings (no speed figure)
event_fuzz  atheris (coverage-guided) on the KV event decoder and the index it feeds: inputs, drops, findings
==========  ==================================================================================================

Benchmarks may import any runtime package (``router``, ``workers``, ``kernels``, ...); no runtime package imports
``benchmarks`` (``tests/test_architecture.py`` checks it).
"""

NAMES: tuple[str, ...] = ("events", "index", "fleet_scale", "policies", "gateway", "long_turns", "huge_prompt",
                          "processes", "sessions", "worker", "kernels", "hybrid", "soak", "chaos",
                          "handoff", "pd", "pool", "pool_churn", "routing", "api_fuzz", "event_fuzz")
"""The benchmark modules, ``benchmarks.<name>``."""
