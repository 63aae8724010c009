"""Fixtures shared by the gateway tests."""

from collections.abc import AsyncIterator

import pytest

from tests.router.fakes import FakeWorker


@pytest.fixture
async def workers() -> AsyncIterator[list[FakeWorker]]:
    """Two started fake workers, ``w0`` and ``w1`` (a module may define its own ``workers`` to get another fleet)."""
    ws = [FakeWorker("w0"), FakeWorker("w1")]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        await w.stop()


@pytest.fixture
async def worker() -> AsyncIterator[FakeWorker]:
    """One started fake worker, ``w0``."""
    w = FakeWorker("w0")
    await w.start()
    yield w
    await w.stop()
