"""``HeapTrimmer.run`` stops when cancelled, also when the cancel comes in the same loop turn as a wake-up (an index
clear's ``request()`` then the gateway's shutdown): ``asyncio.wait_for`` on Python 3.11 returned the wake's result
and dropped the cancel, so the loop went on and shutdown waited on it for good."""

from __future__ import annotations

import asyncio

import pytest

from common.process_stats import HeapTrimmer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


async def test_a_cancel_in_the_same_turn_as_a_wake_stops_the_loop() -> None:
    trimmer = HeapTrimmer(interval_s=3600.0, min_free_bytes=1 << 40)
    task = asyncio.get_running_loop().create_task(trimmer.run())
    for _ in range(3):
        await asyncio.sleep(0)  # the loop is waiting for a wake
    assert trimmer._wake is not None and not task.done()
    trimmer.request()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5.0)
    assert done == {task} and task.cancelled()
    assert trimmer._wake is None  # its ``finally`` ran


async def test_a_wake_alone_trims_and_keeps_waiting() -> None:
    trimmer = HeapTrimmer(interval_s=3600.0, min_free_bytes=1 << 40)
    task = asyncio.get_running_loop().create_task(trimmer.run())
    for _ in range(3):
        await asyncio.sleep(0)
    trimmer.request()
    for _ in range(50):
        await asyncio.sleep(0.01)
    assert not task.done() and trimmer._wake is not None and not trimmer._wake.is_set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5.0)
    assert done == {task} and task.cancelled()
