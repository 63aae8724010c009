"""The C allocator a kvgate process runs under, and the environment that picks one.

CPython's small-object allocator (pymalloc) takes memory in 1 MiB arenas and gives an arena back only when every
object in it is freed: after a load peak a few long-lived values per pool keep most arenas mapped, so the
gateway's RSS stays about a third over its pre-load figure after its index and caches empty (``benchmarks.soak``'s
docstring has the figures). ``PYTHONMALLOC=malloc`` sends every object to the C allocator instead; glibc's then
keeps small free chunks between the survivors. jemalloc (Debian's ``libjemalloc2``, preloaded) returns the freed
pages of its size-class slabs to the kernel by a timed decay (``JEMALLOC_CONF``), which is the documented way to
run the gateway (README's ``kvgate serve``, ``deploy/image/Dockerfile``) and the soak's (``benchmarks.soak``).
"""

from __future__ import annotations

import os

JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib64/libjemalloc.so.2", "/usr/local/lib/libjemalloc.so.2")
"""Where Debian's and Ubuntu's ``libjemalloc2`` (amd64, arm64), Fedora's ``jemalloc`` and a source build put the
library."""

JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,tcache:false,slab_sizes:1-160:1"
"""jemalloc's options (``MALLOC_CONF``) for kvgate: a background thread purges freed pages, so the purge happens
while the process is idle too (without it jemalloc purges only inside allocation calls); pages freed are returned
within about a second (``dirty_decay_ms``, default 10,000) and straight to the kernel (``muzzy_decay_ms:0``:
``MADV_DONTNEED``, which drops them from RSS at once, not ``MADV_FREE``, which leaves them counted until the
kernel needs the memory); no thread caches (``tcache:false``): a thread's cache keeps freed small regions of every
size class, which keeps their slabs in use (the soak's gateway ends 1.12-1.13x its baseline with them, 1.09-1.10x
without; ``benchmarks.soak``'s docstring); one-page slabs for the size classes up to 160 bytes (``slab_sizes``,
in Debian's jemalloc 5.3; a jemalloc without the option warns and ignores it). By default a class's slab is the
fewest whole pages its regions fill exactly (3 pages for the 48-byte class, 5 for 80, 7 for 112), and a slab's
pages go back only when its last region is freed: the gateway's small values (ints, floats, short tuples; a 64-bit
block hash is 36 bytes, the 48-byte class) outnumber the rest, so each value that outlives a load peak kept up to
12-28 KiB of its class active, 4 KiB now. A one-page slab of 48-byte regions holds 85 and leaves 16 bytes unused
(0.4%; at most 2.3% up to 160 bytes, 25 regions a page)."""

ALLOCATORS = ("pymalloc", "malloc", "jemalloc")
"""``allocator_env``'s names: CPython's default, ``PYTHONMALLOC=malloc`` over glibc, and over a preloaded
jemalloc."""


def find_jemalloc() -> str | None:
    """The first of ``JEMALLOC_PATHS`` present, or ``None``."""
    return next((p for p in JEMALLOC_PATHS if os.path.exists(p)), None)


def allocator_env(allocator: str, malloc_conf: str = JEMALLOC_CONF) -> dict[str, str]:
    """The variables that run a new Python process under ``allocator`` (one of ``ALLOCATORS``), to put over its
    environment: ``{}`` for pymalloc; ``PYTHONMALLOC=malloc``; and for jemalloc also ``LD_PRELOAD`` (the library
    found by ``find_jemalloc``, before any ``LD_PRELOAD`` already set in this process's environment) and
    ``MALLOC_CONF=malloc_conf`` (jemalloc's options, ``JEMALLOC_CONF`` by default).

    Raises:
        ValueError: an unknown allocator, or ``"jemalloc"`` with no library at ``JEMALLOC_PATHS``.
    """
    if allocator == "pymalloc":
        return {}
    if allocator == "malloc":
        return {"PYTHONMALLOC": "malloc"}
    if allocator == "jemalloc":
        path = find_jemalloc()
        if path is None:
            raise ValueError(f"no libjemalloc.so.2 at {', '.join(JEMALLOC_PATHS)} (Debian: apt-get install "
                             "libjemalloc2)")
        preload = " ".join(filter(None, [path, os.environ.get("LD_PRELOAD", "")]))
        return {"PYTHONMALLOC": "malloc", "LD_PRELOAD": preload, "MALLOC_CONF": malloc_conf}
    raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {allocator[:40]!r}")
