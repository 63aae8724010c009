"""Under a preloaded jemalloc (``LD_PRELOAD=libjemalloc.so.2``, the gateway's documented way to run), glibc's
``malloc_trim`` and ``mallinfo2`` still resolve, but to glibc's own arena, which holds nothing of the process's
heap: ``common.process_stats`` sees that ``malloc`` is not glibc's and makes the heap figures ``None`` and every
trim a no-op, so the ``HeapTrimmer`` never calls into glibc's allocator beside jemalloc. Run in a fresh interpreter
(the preload must come before the first allocation); skipped where ``libjemalloc.so.2`` is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.allocator import allocator_env, find_jemalloc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc.so.2 not installed (libjemalloc2)")]

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = """
import asyncio, json
from common.process_stats import ALLOCATOR, HeapTrimmer, malloc_stats, malloc_trim, memory_report
chunks = [bytearray(4096) for _ in range(4096)]
del chunks
async def run():
    trimmer = HeapTrimmer(interval_s=3600.0, min_free_bytes=0)
    return [await trimmer.trim_once(force=True), await trimmer.trim_once()], trimmer.num_trims
checks, num_trims = asyncio.run(run())
report = memory_report(0, trim=True)
print(json.dumps({"allocator": ALLOCATOR, "stats": malloc_stats(), "trim": malloc_trim(), "checks": checks,
                  "num_trims": num_trims, "report": [report["allocator"], report["malloc"], report["trimmed"]]}))
"""


def _run(env: dict[str, str]) -> dict[str, object]:
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", SCENARIO], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_under_jemalloc_the_glibc_heap_calls_are_no_ops() -> None:
    env = allocator_env("jemalloc")
    assert env["LD_PRELOAD"] == find_jemalloc() and env["PYTHONMALLOC"] == "malloc"
    out = _run(env)
    assert out == {"allocator": "jemalloc", "stats": None, "trim": False, "checks": [False, False],
                   "num_trims": 0, "report": ["jemalloc", None, False]}


def test_under_glibc_the_heap_is_seen() -> None:
    out = _run({"PYTHONMALLOC": "malloc"})
    assert out["allocator"] == "glibc"
    stats = out["stats"]
    assert isinstance(stats, dict) and stats["in_use_bytes"] > 0
    report = out["report"]
    assert isinstance(report, list) and report[0] == "glibc" and isinstance(report[1], dict)
