"""``IndexState.iota_slice``: consecutive ids by one copy, exact across the table's growth."""

from __future__ import annotations

from array import array

import pytest

from router.index.config import IndexConfig
from router.index.state import IOTA_GROWTH, IndexState

pytestmark = pytest.mark.unit


def test_iota_slices_are_exact_ranges_before_at_and_after_growth() -> None:
    state = IndexState(IndexConfig(block_size=16))
    assert state.iota == array("q", [0])
    assert state.iota_slice(0, 1) == array("q", [0])
    assert state.iota_slice(3, 5) == array("q", range(3, 8))
    assert len(state.iota) == 8 + IOTA_GROWTH
    assert state.iota_slice(8 + IOTA_GROWTH - 2, 4) == array("q", range(8 + IOTA_GROWTH - 2, 8 + IOTA_GROWTH + 2))
    assert len(state.iota) == 8 + IOTA_GROWTH + 2 + IOTA_GROWTH
    assert state.iota == array("q", range(len(state.iota)))
    assert state.iota_slice(5, 0) == array("q")
