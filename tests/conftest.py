"""Suite-wide setup that must happen before any test module is imported, and fixtures several folders share.

Triton chooses its CPU interpreter when a kernel is *defined* (at import of its module), and several folders
(``tests/gpu``, ``tests/kernels``, ``tests/workers``) import ``kernels.*``; so on a machine without CUDA the
interpreter is switched on here, in the root conftest, which pytest loads before collecting any folder.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator

import pytest

from tests.ports import free_port

if importlib.util.find_spec("torch") is not None and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket is listening on (a taken port, for start-up error tests)."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield port


def _dump_asyncio_tasks(nodeid: str) -> None:
    """Print every task of every running event loop with its stack (an idle loop is safe to read from here)."""
    import asyncio
    import gc
    import sys
    import warnings

    with warnings.catch_warnings():  # isinstance on some lazy module objects warns
        warnings.simplefilter("ignore")
        loops = [obj for obj in gc.get_objects()
                 if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running()]
    print(f"\n+++ asyncio tasks of {nodeid} shortly before its timeout +++", file=sys.stderr)
    for loop in loops:
        for _ in range(5):  # the set can change under us: try again
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                continue
        else:
            tasks = []
        for task in tasks:
            print(f"--- {task!r}", file=sys.stderr)
            task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def _dump_safely(nodeid: str) -> None:
    try:
        _dump_asyncio_tasks(nodeid)
    except Exception as exc:  # a diagnostic must never fail the test itself
        print(f"(could not list asyncio tasks: {exc!r})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test that hangs prints its asyncio tasks' stacks 2 s before pytest-timeout stops it (where it waited)."""
    import threading

    marker = item.get_closest_marker("timeout")
    timeout_s = float(marker.args[0]) if marker is not None and marker.args else float(
        item.config.getini("timeout") or 0)
    timer = None
    if timeout_s > 4:
        timer = threading.Timer(timeout_s - 2, _dump_safely, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        return (yield)
    finally:
        if timer is not None:
            timer.cancel()
