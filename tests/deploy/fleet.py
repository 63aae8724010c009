"""A running gateway whose /metrics carries every series the rules and the dashboard read.

Two real sim workers with KV events (``tests.router.sim_fleet``) behind a loopback gateway, then traffic that makes
each callback series appear: non-streamed and streamed completions sharing a prefix (cached tokens, TTFT, honesty
checks), and a restart of one worker that its gateway detects from its new start id (a resync).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

from tests.router.sim_fleet import MODEL, Gw, SimWorker, connected, make_config, running, wait_until

PREFIX = "a shared system prompt for every request of this fleet " * 4
"""A prompt prefix of several blocks: the second request on a worker hits its cache."""

NUM_COMPLETIONS = 6
NUM_STREAMS = 4

_NAME_RE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)


def exported_series(metrics_text: str) -> set[str]:
    """The sample names a /metrics text can carry: each family's name, with ``_total`` for a counter and
    ``_bucket``/``_sum``/``_count`` for a histogram (``_created`` samples are left out)."""
    names: set[str] = set()
    for family, kind in _NAME_RE.findall(metrics_text):
        if kind == "counter":
            names.add(family if family.endswith("_total") else family + "_total")
        elif kind == "histogram":
            names.update(family + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family)
    return names


async def stream(g: Gw, prompt: str, worker: str) -> None:
    """A streamed completion with ``include_usage`` (usage in the last chunk), forced to ``worker``."""
    assert g.session is not None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    async with g.session.post(g.url + "/v1/completions", json=body, headers={"x-kvgate-worker": worker}) as resp:
        assert resp.status == 200
        assert (await resp.read()).rstrip().endswith(b"data: [DONE]")


async def traffic(g: Gw) -> None:
    """Completions and streams on both workers, the same prefix each time (every one after the first on a worker
    is a cache hit)."""
    for i in range(NUM_COMPLETIONS):
        await g.complete(PREFIX + f"question {i}", headers={"x-kvgate-worker": f"w{i % 2}"})
    for i in range(NUM_STREAMS):
        await stream(g, PREFIX + f"streamed question {i}", f"w{i % 2}")


async def resync(g: Gw, worker: SimWorker) -> None:
    """Restart ``worker`` (new start id) and let the gateway's load poll find it: one resync of it."""
    counters = g.gw.subscriber.counters
    before = sum(n for (wid, _), n in counters.resyncs.items() if wid == worker.worker_id)
    await worker.restart()
    await g.gw.fleet.poll_load_once()
    await wait_until(lambda: sum(n for (wid, _), n in counters.resyncs.items() if wid == worker.worker_id) > before,
                     what="a resync")


@contextlib.asynccontextmanager
async def busy_gateway(**overrides: Any) -> AsyncIterator[Gw]:
    """A gateway in front of sim workers w0 and w1 after ``traffic`` and a resync of w1."""
    async with running(SimWorker("w0"), SimWorker("w1")) as workers:
        async with Gw(make_config(workers, **overrides)) as g:
            await connected(g, workers)
            await traffic(g)
            await resync(g, workers[1])
            yield g
