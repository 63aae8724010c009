"""``common.process_stats.memory_report``'s figures, each in a fresh interpreter (tracing and the allocator are chosen
at its start): a traceback site names the innermost frame first; ``collect`` frees reference cycles and counts
them; under a preloaded jemalloc, ``jemalloc_bins`` counts a size class's regions and slabs, and a slab kept by one
live region in two keeps its pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.allocator import allocator_env, find_jemalloc

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def _run(scenario: str, env: dict[str, str]) -> dict[str, object]:
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", scenario], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


TRACEBACK = """
import json
from common.process_stats import memory_report
def inner():
    return [bytearray(1 << 20) for _ in range(8)]
def outer():
    return inner()
kept = outer()
site = memory_report(1, group_by="traceback")["sites"][0]
print(json.dumps({"file": site["file"], "line": site["line"], "size": site["size_bytes"], "stack": site["stack"]}))
"""


def test_a_traceback_site_is_named_by_its_innermost_frame() -> None:
    out = _run(TRACEBACK, {"PYTHONTRACEMALLOC": "3"})
    assert out["file"] == "<string>" and out["line"] == 5
    assert out["stack"] == ["<string>:5", "<string>:5", "<string>:7"]  # the comprehension, inner, outer
    assert isinstance(out["size"], int) and 8 << 20 <= out["size"] < (8 << 20) + 4096


COLLECT = """
import gc, json
from common.process_stats import memory_report
gc.collect()
gc.disable()
def cycles(n):
    for _ in range(n):
        a = []
        b = [a]
        a.append(b)
cycles(1000)
plain = memory_report(0)
collected = memory_report(0, collect=True)
again = memory_report(0, collect=True)
print(json.dumps([plain["num_collected"], collected["num_collected"], again["num_collected"]]))
"""


def test_collect_frees_reference_cycles_and_counts_them() -> None:
    assert _run(COLLECT, {}) == [None, 2000, 0]  # two lists a cycle


BINS = """
import json
from common.process_stats import jemalloc_bins
def bin80():
    return next(b for b in jemalloc_bins(64) if b["region_bytes"] == 80)
for _ in range(3):  # the first readings also allocate what later ones reuse
    bin80()
start = bin80()
again = bin80()  # what one reading keeps allocated itself
kept = [bytes(40) for _ in range(100_000)]  # 73 bytes each: jemalloc's 80-byte class
full = bin80()
del kept[::2]
half = bin80()
print(json.dumps({"start": start, "again": again, "full": full, "half": half, "bins": len(jemalloc_bins(64))}))
"""


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc.so.2 not installed (libjemalloc2)")
def test_jemalloc_bins_count_a_size_class_and_its_idle_slab_bytes() -> None:
    out = _run(BINS, allocator_env("jemalloc", "tcache:false"))
    start, again, full, half = out["start"], out["again"], out["full"], out["half"]
    assert isinstance(start, dict) and isinstance(again, dict) and isinstance(full, dict) and isinstance(half, dict)
    reading = again["num_regions"] - start["num_regions"]
    assert full["num_regions"] - again["num_regions"] == 100_000 + reading
    assert full["num_regions"] - half["num_regions"] == 50_000 - reading
    # Every slab keeps every other region: none is freed, and the freed half stays in them as idle bytes.
    assert half["num_slabs"] == full["num_slabs"] and half["slab_bytes"] == full["slab_bytes"]
    assert half["idle_bytes"] - full["idle_bytes"] == (50_000 - reading) * 80
    assert half["slab_bytes"] - half["idle_bytes"] == half["num_regions"] * 80
    assert out["bins"] == 36  # jemalloc 5's small size classes with 4 KiB pages


def test_jemalloc_bins_is_none_under_another_allocator() -> None:
    assert _run("import json; from common.process_stats import jemalloc_bins; print(json.dumps(jemalloc_bins()))",
                {}) is None


SLABS = """
import json
from common.process_stats import jemalloc_bins
print(json.dumps({b["region_bytes"]: b["slab_bytes"] // b["num_slabs"] for b in jemalloc_bins(64) if b["num_slabs"]}))
"""


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc.so.2 not installed (libjemalloc2)")
def test_kvgate_jemalloc_conf_gives_the_small_classes_one_page_slabs() -> None:
    ours = _run(SLABS, allocator_env("jemalloc"))
    default = _run(SLABS, allocator_env("jemalloc", "tcache:false"))
    assert [ours[k] for k in ("48", "80", "112", "160")] == [4096] * 4
    assert [default[k] for k in ("48", "80", "112", "160")] == [12288, 20480, 28672, 20480]
    assert ours["3072"] == default["3072"] == 12288  # above 160 bytes jemalloc's own sizes stay
