"""A real Prometheus server for tests, on a free 127.0.0.1 port, its TSDB in a temporary directory.

It scrapes one target every ``SCRAPE_INTERVAL_S`` and evaluates the given rule files as often. Tests are skipped,
with the reason, when the ``prometheus`` binary (Debian package ``prometheus``; ``scripts/test`` installs it) is
absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ports import free_port

SCRAPE_INTERVAL_S = 1
_START_TIMEOUT_S = 30.0


def prometheus_binary() -> str:
    """The ``prometheus`` executable; skips the test without one."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; scripts/test installs it)")
    return path


class PrometheusServer:
    """``prometheus`` scraping ``target`` (``host:port``) with ``rule_files``, until ``stop()``.

    Attributes:
        port: its HTTP port on 127.0.0.1.
        directory: config, TSDB and ``prometheus.log``.
    """

    def __init__(self, directory: Path, target: str, rule_files: list[Path]) -> None:
        self.directory = directory
        self.port = free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "kvgate", "static_configs": [{"targets": [target]}]}],
        }
        self.config_path = directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self._log = open(directory / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self._process = subprocess.Popen(
            [prometheus_binary(), f"--config.file={self.config_path}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._is_ready():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(directory / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def _is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1.0) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>`` with ``params``; returns ``data`` (raises on an error status)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """An instant query: per result series, its labels as ``k=v,...`` (sorted, without ``__name__``) -> value."""
        out: dict[str, float] = {}
        for item in self.api("query", query=expr)["result"]:
            labels = ",".join(f"{k}={v}" for k, v in sorted(item["metric"].items()) if k != "__name__")
            out[labels] = float(item["value"][1])
        return out

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
