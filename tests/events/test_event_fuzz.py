"""The coverage-guided fuzzer of the KV event decoder and subscriber (``benchmarks.event_fuzz``, atheris) for a few
seconds, from the vLLM and SGLang captures: no input raises or logs a traceback, every refused payload and message
is counted, every decoded event keeps its invariants, and the index fed the batches passes ``check_invariants``
throughout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"event fuzz: (\d+) inputs \((\d+) structured, (\d+) messages through the subscriber giving "
                     r"(\d+) records and (\d+) resyncs\), (\d+) decoded with (\d+) events, (\d+) refused; "
                     r"(\d+) drops counted \((.*)\); (\d+) index invariant checks passed")


def test_fuzzed_event_payloads_never_raise_and_are_counted(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "event_fuzz", "--max-total-time-s", "8", "--seed", "20",
         "--corpus", str(tmp_path / "corpus"), "--artifact-prefix", f"{tmp_path}/"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not list(tmp_path.glob("crash-*")), out[-4000:]
    found = SUMMARY.search(proc.stdout)
    assert found, out[-4000:]
    (num_inputs, num_structured, num_messages, num_records, num_resyncs, num_decoded, _, num_refused,
     num_drops) = map(int, found.groups()[:9])
    kinds = dict(item.rsplit(" ", 1) for item in found.group(10).split(", "))
    assert num_inputs >= 2_000 and num_structured > 0 and num_messages > 0 and num_records > 0 and num_resyncs > 0
    assert num_decoded + num_refused + num_messages == num_inputs
    assert int(kinds["malformed_payload"]) >= num_refused  # each refusal counted (messages' ones too)
    assert num_drops >= num_refused and int(kinds["frame_count"]) > 0 and int(kinds["bad_seq_frame"]) > 0
    assert int(found.group(11)) >= num_inputs // 512 + 1  # the index checks ran, the last one at the end
    assert "seed corpus: files: 13" in proc.stderr  # the captures of tests/fixtures/events
