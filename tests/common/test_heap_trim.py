"""``common.process_stats``'s view of the C heap: ``malloc_stats`` sees freed chunks kept by glibc, and a trim
(``HeapTrimmer``) gives their pages back to the kernel (RSS read from ``/proc/self/statm``). Linux with glibc only.

The trim scenario runs in a fresh interpreter: in the test process, free chunks that earlier tests left in the
arena (trimmed, so no longer resident, but still free in ``malloc``'s books) take the scenario's allocations, its
release then adds no free bytes, and the trimmer's rule (free bytes grown since the last trim) sees nothing to trim;
a fresh heap has no such holes, so the figures no longer depend on which tests ran before."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.process_stats import HeapTrimmer, malloc_stats, resident_bytes

pytestmark = [pytest.mark.unit, pytest.mark.skipif(malloc_stats() is None, reason="needs glibc 2.33+")]

CHUNK_BYTES = 4096
NUM_CHUNKS = 16_384  # 64 MiB, in malloc's arena (over pymalloc's 512-byte limit, under mmap's threshold)
ROOT = Path(__file__).resolve().parents[2]


def _fragmented_release() -> list[bytearray]:
    """Allocate 64 MiB in 4 KiB chunks and one small block after them, then free the chunks: they coalesce into
    free space below a live block, which glibc neither unmaps nor trims by itself."""
    chunks = [bytearray(CHUNK_BYTES) for _ in range(NUM_CHUNKS)]
    pin = [bytearray(CHUNK_BYTES)]
    for c in chunks:
        c[0] = 1  # touch: resident
    del chunks
    return pin


def trim_scenario() -> dict[str, int | bool]:
    """A forced trim (a clean start), the fragmented release, a periodic check, then another one with nothing new
    freed; run in a fresh interpreter by the test (module docstring). Byte counts are in bytes."""

    async def run() -> dict[str, int | bool]:
        trimmer = HeapTrimmer(interval_s=3600.0, min_free_bytes=32 << 20)
        await trimmer.trim_once(force=True)  # a clean start
        pin = _fragmented_release()
        stats = malloc_stats()
        assert stats is not None
        rss_before = resident_bytes()
        assert rss_before is not None
        periodic = await trimmer.trim_once()  # free bytes grew past min_free_bytes since the last trim
        rss_after = resident_bytes()
        assert rss_after is not None
        again = await trimmer.trim_once()  # nothing new freed since: no trim
        del pin
        return {"free_bytes": stats["free_bytes"], "periodic": periodic, "again": again,
                "released": rss_before - rss_after, "num_trims": trimmer.num_trims,
                "num_released": trimmer.num_released_bytes}

    return asyncio.run(run())


def test_trim_returns_freed_chunks_to_the_kernel():
    code = "import json; from tests.common.test_heap_trim import trim_scenario; print(json.dumps(trim_scenario()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["free_bytes"] >= NUM_CHUNKS * CHUNK_BYTES // 2
    assert out["periodic"] and not out["again"]
    assert out["released"] >= 32 << 20, f"released {out['released'] / 2**20:.1f} MiB"
    assert out["num_trims"] >= 1 and out["num_released"] >= 32 << 20


def test_no_trim_below_the_growth_threshold():
    async def run() -> bool:
        trimmer = HeapTrimmer(interval_s=3600.0, min_free_bytes=1 << 40)
        return await trimmer.trim_once()

    assert sys.platform.startswith("linux")
    assert asyncio.run(run()) is False
