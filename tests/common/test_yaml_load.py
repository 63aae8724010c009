"""``common.yaml_load``: YAML 1.2 exponent floats in config files, and the README's PD example loading as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from common.yaml_load import safe_load_yaml
from router.config import load_config
from workers.config import load_profile

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_exponent_floats_load_as_floats_and_the_rest_as_safe_load():
    text = "a: 25.0e9\nb: 1e9\nc: 1E-3\nd: .5e3\ne: 25.0e+9\nf: '1e9'\ng: 12\nh: 1.5\ni: e9\nj: 1e\nk: .inf\n"
    assert safe_load_yaml(text) == {"a": 25.0e9, "b": 1.0e9, "c": 0.001, "d": 500.0, "e": 25.0e9, "f": "1e9",
                                    "g": 12, "h": 1.5, "i": "e9", "j": "1e", "k": float("inf")}
    loaded = safe_load_yaml("x: 12\ny: 12e0\n")
    assert isinstance(loaded, dict) and type(loaded["x"]) is int and type(loaded["y"]) is float
    assert yaml.safe_load("a: 1e9") == {"a": "1e9"}  # PyYAML's own SafeLoader is left as it was


def test_readme_pd_example_loads_with_its_exponent_float(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Disaggregated fleets (prefill / decode)", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    text = block.group(1).replace("NAME", "llama-3-8b") + "admin: {token: t}\n"
    (tmp_path / "g.yaml").write_text(text, encoding="utf-8")
    cfg = load_config(tmp_path / "g.yaml")
    pd = cfg.models[0].pd
    assert pd is not None and pd.protocol == "vllm" and pd.link_bytes_per_s == 25.0e9 and pd.queue_timeout_s == 5.0
    assert [(w.id, w.role) for w in cfg.workers] == [("p0", "prefill"), ("d0", "decode")]


def test_worker_profile_reads_exponent_floats(tmp_path):
    (tmp_path / "p.yaml").write_text("time-scale: 1e-1\n", encoding="utf-8")
    assert load_profile(tmp_path / "p.yaml") == {"time-scale": 0.1}


def test_readme_local_pd_fleet_config_loads(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"  cat > pd.yaml <<'YAML'\n(.*?)  YAML\n", readme, re.S)
    assert block is not None
    text = "\n".join(line.removeprefix("  ") for line in block.group(1).splitlines())
    (tmp_path / "pd.yaml").write_text(text, encoding="utf-8")
    cfg = load_config(tmp_path / "pd.yaml")
    pd = cfg.models[0].pd
    assert pd is not None and pd.protocol == "vllm"
    assert [(w.id, w.role, w.events_endpoint) for w in cfg.workers] == [
        ("p0", "prefill", "tcp://127.0.0.1:5571"), ("d0", "decode", "tcp://127.0.0.1:5572")]
