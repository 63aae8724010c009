"""Shared pool tier benchmarks (``python -m benchmarks.pool``); each figure beside a baseline from the same run.

1. Store and restore throughput through the worker's pool tier (``workers.kv.pool_tier.PoolTier`` over
   ``MooncakePoolStore``: ``prepare_store`` + ``complete_store``, which checks existence, builds the chunks in a
   staging buffer, puts them and announces; ``fetch``, which reads them and checks every byte) against the raw
   Mooncake client's batch calls on the same chunks (under other keys, so all really write): ``put_batch`` /
   ``get_batch`` (Python bytes) and ``batch_put_from`` / ``batch_get_into`` (registered buffers, its fastest
   path), against one ``mooncake_master`` on 127.0.0.1 started here. Runs interleaved, best of ``--repeats``
   after ``--warmup`` rounds; ratio worker ÷ raw (target ≥ 0.9). The worker's store includes building the
   chunks (the sim engine's stand-in for the GPU -> host copy: a manifest and each layer group's token ids,
   padded to ``--value-bytes``) and its existence check (store rule 2); its restore includes checking the chunks
   (``--verify all_bytes``: every byte; ``manifest``: all but the sim's zero padding). What the worker adds inside
   the timing, measured per 256-block batch of 256 KiB chunks on a loaded 2-core host: the store's existence
   check (one ``batch_is_exist``, 0.6-0.9 ms) and chunk build (0.4-0.7 ms) beside a 13-15 ms put; the restore's
   checks, 0.5-1 ms for ``manifest`` and about 6 ms for ``all_bytes`` (a second pass over every byte, memory
   bound) beside a 15-20 ms read. Reading the next batch on another thread while one is checked was slower there
   (the transfer's own threads need the cores), so ``all_bytes`` stays about 0.78 of the raw read on such a
   host and ``manifest`` about 1.1. Beside them, the same batch's bytes as one object (``batch_put_from`` /
   ``batch_get_into`` of one key) give the per-object cost of the batch calls: with the agentic scenario's
   blocks (``--num-blocks 558 --block-size 64 --value-bytes 889``, one client on the loaded 2-core host) one
   object moves the bytes 12-13× faster than 558 (3-5 us per object per call); there the worker with one object
   per block (``--blocks-per-span 1``) reaches about 0.5 of the raw batch calls. The worker is driven as its KV
   manager drives it: each block's tokens packed once when its hash is computed (``extend_block_hashes``'
   ``payloads``, handed to ``prepare_store`` and ``fetch``), the restore given the objects its lookup found
   (``PoolHit.objects``, built outside the timing as the raw calls' keys are), the stored blocks still on GPU (the
   ``BlockStored`` event token-less). A store builds and a restore checks a batch's chunks as one run
   (``ChunkLayout.write_run`` / ``check_run``: numpy columns, and every byte compared with the chunks rebuilt;
   chunks of 64 KiB or more: see the real block sizes below).
   Figures (558 blocks of 889 bytes, a loaded 2-core host at load 3.2-3.9, three interleaved rounds, best of 5):
   spans (16 blocks per object, 48 objects) store 3.4-5.6 us per block, restore 2.0-2.8 us, 0.34-0.52 and
   0.31-0.38 of the raw batch call on the worker's own 48 objects (``spans_put_from`` / ``spans_get_into``; before
   the runs, 6.2-10.1 and 3.7-7.0 us, 0.14-0.18 and 0.14-0.19), 1.6-2.5 and 1.6-3.0 of the raw per-block calls;
   one block per object (``--blocks-per-span 1``) store 10.7-13.4 us, restore 5.6-7.2 us (before: 13.1-25.4 and
   10.7-12.9; the layout before spans, same rounds: 13.9-24.7 and 7.8-13.5). The "before" figures are the
   earlier code as this benchmark then drove it (tokens packed at every store and restore, the restore building its
   objects' keys, the store's event with tokens); driven that way the new code restores spans in 4.3-4.8 us per
   block and single blocks in 10.3-11.0 us, so most of the single-block gain is the packing kept from the hashing
   and the keys kept from the lookup, and the rest of that layout's cost is Python objects per object (its
   ``PoolObject``, the garbage collector's passes over them: with the collector off it restores as fast as the
   layout before spans). What is left per block beside the raw
   call on the spans: the store's existence check (store rule 2, one ``batch_is_exist``, about 0.5 us per block),
   the chunk build and the restore's check (0.3-0.4 us per block each: an ``xxh3_64`` call per block, the numpy
   column copies and a pass over every byte), the key building of the store's spans and its bookkeeping (the known
   objects, the event). Every restored byte is compared, so a restore stays a pass over the bytes behind the raw
   read; the raw read of 48 objects is itself only 0.6-0.8 us per block here.
   The raw span calls (``spans_put_from`` / ``spans_get_into``) use the worker's own keys under another prefix
   (``_RAW_PREFIX``, as long: 80-320 characters; short keys are printed beside, about 10-20% faster per call), and
   the last line prints worker ÷ raw on those objects, the same-data ratio. Each round collects garbage once after
   its setup: before, the setup's 558 token tuples were scanned by the first young collection inside a timing,
   nearly always the worker's restore (0.4 ms of its 1.1 ms). Figures then (558 blocks of 889 bytes, load 3.5-5.3,
   best of 9, two interleaved process pairs): restore 1.29-1.30 us per block, 0.32-0.33 of the raw call; store
   2.22-2.39 us, 0.28-0.30.
   Real block sizes: the sim timing profile's KV is 131,072 bytes per token (``TimingProfile.kv_bytes_per_token``,
   Llama-3-8B in bf16: 2 × 32 layers × 8 KV heads × 128 × 2 bytes), so a GPU worker's chunk is 2 MiB at the default
   16-token blocks and 8 MiB at the agentic scenario's 64: ``--num-blocks 128 --block-size 16 --value-bytes 2097152``
   and ``--num-blocks 32 --block-size 64 --value-bytes 8388608`` (256 MiB a batch; the master's segment is sized to
   12 batches: every contender's copy, and a large put fails for space below about that), at the default 16 blocks
   per span (objects of 32 and 128 MiB) and at ``--blocks-per-span 1`` (per-object costs are nothing beside such
   chunks). There the raw calls are copies over loopback TCP (6-10 GB/s on the 2-core host) and the store keeps up
   with them (its build writes only each chunk's manifest and payload: the padding stays zero in the staging buffer):
   0.87-1.06 of the raw put before and after. The restore was 0.26-0.53: ``check_run`` rebuilt every chunk in a
   scratch buffer and compared the two, two reads and a write of every byte. Now a chunk of 64 KiB or more is checked in
   one read of its bytes (the manifests and payloads compared with the ones expected, each padding range against zeros),
   and a restore of 16 MiB or more is read in batches of about an eighth (at least 8 MiB), the next read on a thread of
   its own while one is checked (``PoolTier``'s ``read_ahead``; the reader is started before the check holds the GIL,
   ``pool_read.submit_started``, else it started up to a switch interval late).
   Figures (loaded 2-core host, load 2.8-8.8, the code before and after run in turn, three or four pairs, best
   of 5; before → after, worker ÷ raw on its own objects): 2 MiB chunks store 0.98-1.06 → 0.93-0.98, restore
   0.46-0.53 → 0.59-0.63 (worker 3.7-4.2 GB/s against 6.2-6.6); 8 MiB chunks store 0.97-1.00 → 0.87-0.98, restore
   0.26-0.40 → 0.30-0.57 (3.4-5.2 GB/s against 7.4-10.1: two 128 MiB objects, so only the first one's check is
   hidden, and the runs at load 5-7 swing most: 0.30 and 0.35 in two where the raw put ran at half its speed); 8 MiB,
   one block per object, store 0.90-1.00 → 0.94-0.97, restore 0.48-0.51 → 0.57-0.62. The restore stays short of 0.9
   on this host: checking every byte reads them once more at about the speed the loopback copy writes them, and the
   read ahead overlaps the two only where a core is free (on the loaded host the next read slows from 5.7 to 8.5 ms
   per 32 MiB while a batch is checked; the last batch's check, an eighth, is never hidden).
   The padding ranges were hashed with ``xxh3_128`` (against the digest of as many zeros), which holds the GIL: one
   core, and the read ahead's Python parts waited behind it. Now they are compared exactly, as 64-bit words whose
   maximum must be zero (``workers.kv.pool_zero``: numpy's reduction releases the GIL), in 2 MiB slices split over
   half the host's cores (``os.sched_getaffinity``, at most 8; one on the 2-core host, where two were slower
   beside the transfer's threads: 2 MiB chunks 0.53 and 0.68 against 0.65 and 0.62 on one, 8 MiB 0.52 and 0.49
   against 0.54 and 0.59), so an 8 MiB × 16-block span, one 128 MiB object and so one read, is checked on several
   cores at once. Over 128 MiB of zeros on one thread here: 8.6-11.5 GB/s against 7.0-8.3 for ``xxh3_128``
   (three runs, load 3.2). Figures (2-core host, load 1.1-4.9, ``--repeats 5 --history-tokens 1024``, eight
   interleaved before/after pairs; worker ÷ raw on its own objects): 2 MiB chunks restore 0.53-0.86 → 0.60-0.89
   (better in seven pairs, the eighth 0.66 → 0.65), 8 MiB chunks 0.41-0.66 → 0.35-0.69 (better in five; worker
   3.8-4.7 → 3.0-5.8 GB/s in five pairs), stores 0.74-1.33 → 0.88-1.33 (the store path unchanged); the
   889-byte chunks do not take this path (shorter than 64 KiB: rebuilt and compared), store 0.32-0.51 →
   0.30-0.38 and restore 0.29-0.68 → 0.31-0.50 in six pairs, noise. On a quiet 16-core host before: 2 MiB store
   1.03, restore 0.88 (worker 5.3 GB/s against 6.1); 8 MiB store 0.98, restore 0.74 (4.7 against 6.4); 889 bytes
   store 0.35, restore 0.49 (after: not yet measured there). Short chunks are still rebuilt and compared in one
   ``memcmp`` (faster there than columns: 80 against 120-180 us for 558 chunks of 889 bytes), so the 889-byte
   figures were unchanged within the noise by the one-read check (four pairs, best of 9: store 0.31-0.33 → 0.32-0.35,
   restore 0.31-0.39 → 0.31-0.34; a hot restore of the same 48 objects 447-484 us before, 466-475 after,
   beside a raw read of 237-268). The store makes one existence call (store rule 2); the master's own check in the
   put cannot stand in for it (``batch_put_from`` of a key already there returns 0, in 70-400 us, no transfer: the
   worker could not tell its blocks from another worker's), and running the check on a thread while the chunks are
   built was slower on this host (1.92 against 1.76 ms best for 558 blocks: the handoff costs more than the build it
   hides).
   Per block in Python, then (558 blocks of 889 bytes, each step timed in 40 fresh rounds on the loaded 2-core host,
   best, before → after): a span key's member tags from one numpy column of the joined hashes (``store_objects``:
   56 → 34 us hot), the chunk build in the staging slots themselves (``write_run`` 100 → 88 us), a job's positions
   as one range, the store's filters skipped when nothing is in flight or present (``prepare_store`` with its
   existence call 400-461 → 354-355 us); a restore planned as one batch when it fits, its plan checked per
   object rather than per block (``read_objects``' compare of every member's hash), each batch's sizes and
   offsets made once (``read_objects`` with the read and check 489-608 → 429-467 us, ``fetch`` 575-715 →
   510-543). Benchmark, eight interleaved before/after pairs, best of 9, load 2.3-3.7: store 0.34-0.40 →
   0.34-0.45 (better in five pairs, the same in two), restore 0.34-0.41 → 0.36-0.42 (better in seven); the
   2 MiB and 8 MiB chunks, whose paths this leaves as they were, within the noise (8 MiB restore 0.69-0.78 →
   0.65-0.83 in five pairs, stores 0.97-1.09 → 0.90-1.11). What stays beside the raw calls at 889 bytes is mostly not
   bookkeeping: the store's existence call (150-180 us, store rule 2) and chunk build (90-120 us) beside a put of
   750-1000 us, the restore's check (110-140 us on bytes just landed, 70-80 hot) beside a read of 240-300 us, so
   this host would give about 0.75 and 0.7 with no Python at all. Tried and left out: rebuilding the restore's
   chunks while the read runs, on two threads (the client releases the GIL; ``ChunkLayout.check_run`` then only
   compares): slower here either way round (the rebuild on a thread and the read here, or the other way), 444-455
   against 388-396 us best over 500 interleaved hot restores, the read itself slowing from about 200 to 320-500
   us beside the rebuild (the transfer's own threads need the two cores); it may pay on a host with cores to
   spare, not measured. Cutting a large object into ranged reads, so that a 128 MiB span is checked in pieces
   while the next piece is read (the client's ``get_into_ranges``, mooncake-transfer-engine 0.3.13): 76-86 ms
   for 128 MiB in 16 MiB ranges against 12 ms for one ``batch_get_into`` of it. The zero check itself is not
   what bounds the large chunks: 25-27 GB/s on one thread over 128 MiB (``maximum.reduce`` of 64-bit words, 2 MiB
   slices), beside a loopback read of 7-10 GB/s; with two 128 MiB objects what is left is the second one's
   check, unhidden (about 5 ms beside a 20 ms read of both), and the first one's beside the second read on two
   shared cores.
2. TTFT of a 100K-token history restored from the pool against recomputing it, under the sim timing model
   (``workers.engines.sim``, default H200 profile): the scheduler and sim engine run the turn on a worker whose GPU
   is cold, once with the history in the pool (stored by another worker) and once without; TTFT is the sum of the
   simulated step times up to the first output token.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.pool_keys import KEY_PREFIX
from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.block_pool import BlockMeta
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.manager import KVCacheManager
from workers.kv.pool_spans import objects_of, store_objects
from workers.kv.pool_tier import MooncakePoolStore, PoolTier, SimPool
from workers.scheduler import Request, Scheduler

_RAW_PREFIX = "rawkvg/v1/"
"""The raw calls' keys: the worker's keys with this prefix instead of ``KEY_PREFIX`` (as long), so all really write."""


def start_master() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(  # noqa: S603 - a fixed binary, no shell
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_port=0", "--default_kv_lease_ttl=500"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("mooncake_master did not start")


def one_round(tier: PoolTier, store: MooncakePoolStore, rep: int, args: argparse.Namespace) -> dict[str, float]:
    """GB/s of each operation on one batch of new blocks; the order of the contenders alternates with ``rep``."""
    bs = args.block_size
    tokens = [rep * 10_000_000 + i for i in range(args.num_blocks * bs)]
    payloads: list[bytes] = []  # each block's tokens as hashed, as a sequence keeps them (SequenceKV.block_payloads)
    hashes = extend_block_hashes([], namespace_root(), tokens, bs, payloads)
    metas = [  # as the worker's KV manager builds them (its engine hash computed once)
        BlockMeta(
            h, hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]), i, None, None, to_engine_hash(h)
        )
        for i, h in enumerate(hashes)
    ]
    layout, n = tier.layout, len(metas)
    step = layout.chunk_bytes
    values = [layout.build(m.block_hash, m.token_ids) for m in metas]  # the worker's exact chunks
    objects = store_objects(metas, tier.span_len, 0)  # the worker's objects: spans, then the tail's singles
    hit = objects_of(metas, tier.span_len)  # what a lookup hands the restore (PoolHit.objects)
    span_offsets = [lo * step for _, lo, _ in objects]
    span_sizes = [(hi - lo) * step for _, lo, hi in objects]
    staged = store.new_buffer(n * step)
    for i, v in enumerate(values):
        staged.view[i * step : (i + 1) * step] = v
    landing = store.new_buffer(n * step)
    offsets = range(0, n * step, step)
    raw = store._store
    keys = {who: [f"{who}/{rep}/{i}" for i in range(n)] for who in ("put_batch", "batch_put_from")}
    keys["spans"] = [_RAW_PREFIX + k[len(KEY_PREFIX) :] for k, _, _ in objects]  # the worker's keys, as long
    keys["spans_short"] = [f"spans/{rep}/{i}" for i in range(len(objects))]
    packed_key = f"packed/{rep}"
    nbytes = n * step
    timed: dict[str, float] = {}
    contenders = {
        "store": ["worker", "put_batch", "batch_put_from", "spans_put_from", "spans_short_put_from", "packed_put"],
        "restore": ["worker", "get_batch", "batch_get_into", "spans_get_into", "spans_short_get_into", "packed_get"],
    }
    gc.collect()  # the setup's young objects (its blocks' token tuples) scanned here, not in whichever timing is next
    for phase, names in contenders.items():
        order = names if rep % 2 == 0 else names[::-1]
        for who in order:
            t = time.perf_counter()
            if who == "worker" and phase == "store":
                assert len(tier.prepare_store(rep, hashes, metas, 0, payloads)) == n
                tier.complete_store(rep)
            elif who == "worker":
                assert tier.fetch(metas, hit, payloads) == n
            elif who == "put_batch":
                assert raw.put_batch(keys["put_batch"], values) == 0
            elif who == "batch_put_from":
                codes = raw.batch_put_from(keys["batch_put_from"], [staged.address + o for o in offsets], [step] * n)
                assert codes == [0] * n
            elif who in ("spans_put_from", "spans_short_put_from"):
                ptrs = [staged.address + o for o in span_offsets]
                assert raw.batch_put_from(keys[who[: -len("_put_from")]], ptrs, span_sizes) == [0] * len(objects)
            elif who in ("spans_get_into", "spans_short_get_into"):
                ptrs = [landing.address + o for o in span_offsets]
                assert raw.batch_get_into(keys[who[: -len("_get_into")]], ptrs, span_sizes) == span_sizes
            elif who == "packed_put":
                codes = raw.batch_put_from([packed_key], [staged.address], [nbytes])
                assert codes == [0], codes
            elif who == "packed_get":
                assert raw.batch_get_into([packed_key], [landing.address], [nbytes]) == [nbytes]
            elif who == "get_batch":
                assert raw.get_batch(keys["put_batch"]) == values
            else:
                got = raw.batch_get_into(keys["batch_put_from"], [landing.address + o for o in offsets], [step] * n)
                assert got == [step] * n
            name = who if who.startswith(("packed", "spans")) else f"{who}_{phase}"
            timed[name] = nbytes / (time.perf_counter() - t) / 1e9
    assert landing.data == staged.data
    raw.batch_remove([k for k, _, _ in objects] + keys["put_batch"] + keys["batch_put_from"] + keys["spans"]
                     + keys["spans_short"] + [packed_key], True)  # fmt: skip
    store.release_buffer(staged)
    store.release_buffer(landing)
    return timed


def throughput(args: argparse.Namespace) -> None:
    proc, address = start_master()
    try:
        nbytes_per_batch = args.num_blocks * max(args.value_bytes, 64 + 4 * args.block_size * args.layer_groups)
        segment_bytes = max(1 << 30, 12 * nbytes_per_batch)  # every contender's copy of the batch, and room
        store = MooncakePoolStore(address, global_segment_size=segment_bytes, local_buffer_size=256 << 20)
        tier = PoolTier(store, args.block_size, lambda event: None, lambda hashes: True,  # blocks on GPU: token-less
                        value_bytes_per_block=args.value_bytes,
                        num_layer_groups=args.layer_groups, check_padding=args.verify == "all_bytes",
                        blocks_per_span=args.blocks_per_span)  # fmt: skip
        best: dict[str, float] = {}
        for rep in range(args.warmup + args.repeats):  # warm-up rounds touch the segment's pages first
            for name, gbps in one_round(tier, store, rep, args).items():
                if rep >= args.warmup:
                    best[name] = max(best.get(name, 0.0), gbps)
        nbytes_per_batch = args.num_blocks * tier.layout.chunk_bytes
        num_spans = args.num_blocks // args.blocks_per_span
        num_objects = num_spans + args.num_blocks - num_spans * args.blocks_per_span
        print(f"pool throughput, {args.num_blocks} blocks × {tier.layout.chunk_bytes} B chunks "
              f"({args.layer_groups} layer groups, verify {args.verify}) per batch, {num_objects} objects "
              f"({args.blocks_per_span} blocks per span), best of {args.repeats}:")  # fmt: skip

        def us_per_block(gbps: float) -> float:
            return float(nbytes_per_batch / (gbps * 1e9) / args.num_blocks * 1e6)

        for phase, raws in (("store", ("put_batch", "batch_put_from", "spans_put_from")),
                            ("restore", ("get_batch", "batch_get_into", "spans_get_into"))):  # fmt: skip
            w = best[f"worker_{phase}"]
            ratios = ", ".join(f"raw {r} {best[r if r.startswith('spans') else f'{r}_{phase}']:.3f} GB/s "
                               f"(ratio {w / best[r if r.startswith('spans') else f'{r}_{phase}']:.3f})"
                               for r in raws)  # fmt: skip
            print(f"  {phase:7}: worker {w:.3f} GB/s ({us_per_block(w):.2f} us/block); {ratios}")
        print("  (raw spans_*: the raw batch call on the worker's own objects: the same keys but their prefix, the "
              "same sizes)")  # fmt: skip
        short = {p: best[f"spans_short_{op}"] for p, op in (("store", "put_from"), ("restore", "get_into"))}
        print(f"  raw spans_* with short keys (spans/<round>/<i>, about 12 characters against the worker's 80-320): "
              f"store {short['store']:.3f} GB/s, restore {short['restore']:.3f} GB/s")  # fmt: skip
        print(f"  worker / raw on the worker's own objects (target >= 0.9): "
              f"store {best['worker_store'] / best['spans_put_from']:.2f}, "
              f"restore {best['worker_restore'] / best['spans_get_into']:.2f}")  # fmt: skip
        per_object_s = {
            phase: max(0.0, nbytes_per_batch / 1e9 * (1 / best[f"batch_{op}_{phase}"] - 1 / best[packed]))
            / args.num_blocks for phase, op, packed in (("store", "put_from", "packed_put"),
                                                        ("restore", "get_into", "packed_get"))
        }  # fmt: skip
        print(f"  the same bytes as one object (raw batch_put_from / batch_get_into of one key): put "
              f"{best['packed_put']:.3f} GB/s, get {best['packed_get']:.3f} GB/s; per-object cost of the batch "
              f"calls: store {per_object_s['store'] * 1e6:.1f} us, restore {per_object_s['restore'] * 1e6:.1f} us "
              f"per block")  # fmt: skip
        store.close()
    finally:
        proc.terminate()
        proc.wait(10)


def ttft(num_tokens: int) -> tuple[float, float, int]:
    """Simulated TTFT of a ``num_tokens`` history plus one token: (restored from the pool, recomputed, blocks)."""
    bs = 16
    pool = SimPool(num_tokens // bs + 64)
    prompt = list(range(num_tokens))
    config = KVCacheConfig(num_gpu_blocks=num_tokens // bs + 256, block_size=bs)

    def run(kv: KVCacheManager, tokens: list[int]) -> tuple[float, Request]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192), kv, None)
        engine = SimEngine(TimingProfile(), bs, [7], None)
        req = Request("r", tokens, 1, SamplingParams(), ignore_eos=True)
        sched.add_request(req)
        elapsed = 0.0
        while req.num_output_tokens == 0:
            result = engine.execute(sched.schedule())
            elapsed += result.duration_s
            sched.update(result)
        while sched.has_work() or engine.has_pending_copies():  # the stores land
            sched.update(engine.execute(sched.schedule()))
        return elapsed, req

    writer = KVCacheManager(config, pool_store=pool.attach())
    run(writer, prompt)
    restored_s, req = run(KVCacheManager(config, pool_store=pool.attach()), prompt + [1])
    recomputed_s, _ = run(KVCacheManager(config), prompt + [1])
    assert req.num_cached_tokens_by_medium[2] == num_tokens
    return restored_s, recomputed_s, num_tokens // bs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=256, help="blocks per batch")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--value-bytes", type=int, default=256 << 10, help="bytes per block value")
    parser.add_argument("--layer-groups", type=int, default=1, help="pieces per chunk (workers.kv.pool_chunk)")
    parser.add_argument(
        "--blocks-per-span",
        type=int,
        default=16,
        help="blocks per pool object along a chain (PoolConfig.blocks_per_span; 1: one per block)",
    )
    parser.add_argument(
        "--verify",
        choices=("all_bytes", "manifest"),
        default="all_bytes",
        help="what the worker's restore checks (PoolConfig.verify)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="rounds run first and not counted")
    parser.add_argument("--history-tokens", type=int, default=100_000)
    parser.add_argument("--skip-mooncake", action="store_true", help="only the TTFT figure")
    args = parser.parse_args()
    if not args.skip_mooncake:
        throughput(args)
    restored, recomputed, blocks = ttft(args.history_tokens)
    print(f"TTFT of a {args.history_tokens}-token history + 1 token (sim timing model, {blocks} blocks): "
          f"restored from the pool {restored:.3f} s, recomputed {recomputed:.3f} s, "
          f"ratio {recomputed / restored:.1f}×")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
