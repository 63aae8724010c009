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
