"""``./scripts/test --help`` prints its usage and exits 0 without setting anything up or running any test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_scripts_test_help_prints_usage_and_runs_nothing(flag):
    done = subprocess.run([str(ROOT / "scripts" / "test"), flag], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0
    assert done.stdout.startswith("Usage: ./scripts/test [pytest args...]\n")
    assert "KVGATE_SKIP_INTEROP=1" in done.stdout and "./scripts/test tests/router/test_config.py" in done.stdout
    assert "== ruff" not in done.stdout and done.stderr == ""
