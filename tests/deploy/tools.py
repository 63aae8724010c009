"""Paths of the deploy/ files under test, and the tools that check them (skipping the test, with the reason, when
a tool is not installed)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = [RULES_DIR / "recording.yml", RULES_DIR / "alerts.yml"]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate.json"

# A kvgate series in PromQL: a raw one (kvgate_...) or a recorded one (level:kvgate_...:ops, kvgate:...:ops).
_SERIES_RE = re.compile(r"\b(kvgate_[a-z0-9_]+|[a-z]+:kvgate_[a-z0-9_]+:[a-z0-9_]+|kvgate:[a-z0-9_]+:[a-z0-9_]+)\b")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/test installs it)")
    return path


def rules(path: Path) -> list[dict[str, Any]]:
    """Every rule of a rule file, groups flattened."""
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def series_in(expr: str) -> set[str]:
    """Every kvgate series (raw or recorded) a PromQL expression names."""
    return set(_SERIES_RE.findall(expr))
