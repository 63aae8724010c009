"""Kernel tests run on the GPU when there is one, else in Triton's CPU interpreter at small sizes.

Triton picks the interpreter when a kernel is *defined* (at import of its module); the root ``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` on machines without CUDA before any folder is collected (kept here too for runs rooted
in this folder).
"""

from __future__ import annotations

import os

import pytest

try:
    import torch
except ImportError:  # the gpu extra is not installed: the test modules skip themselves
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """Where kernel inputs live: ``cuda`` on a GPU machine, ``cpu`` under the interpreter."""
    assert torch is not None
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed() -> None:
    if torch is not None:
        torch.manual_seed(1234)
