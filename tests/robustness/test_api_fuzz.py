"""schemathesis against a live gateway over sim workers (``benchmarks.api_fuzz``, a short run): for every operation
of ``GET /openapi.json``, the first coverage-phase cases (boundaries, missing and mistyped fields, undeclared
methods, no ``Authorization``), then positive and negative cases. No 5xx that is not a worker's, every 4xx an
OpenAI error in JSON, every answer as the document says (status, content type, headers, body), every
schema-violating request refused, and no traceback or ERROR in the gateway's log."""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("schemathesis")

from benchmarks.api_fuzz import live_fleet, print_report, run_fuzz  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

MAX_EXAMPLES = 8
"""Examples per operation and mode."""
MAX_COVERAGE_CASES = 40
"""Coverage cases per operation (every one of most operations): about 800 cases in all, 40-60 s on a busy 2-core
host (``python -m benchmarks api_fuzz`` sends every coverage case and more examples)."""


def test_fuzzed_api_answers_every_case_as_documented(capsys):
    with live_fleet() as fleet:
        document = requests.get(fleet.url + "/openapi.json", timeout=10).json()
        report = run_fuzz(fleet, max_examples=MAX_EXAMPLES, time_budget_s=150.0, seed=20,
                          max_coverage_cases=MAX_COVERAGE_CASES)
    print_report(report)
    printed = capsys.readouterr().out
    assert report.findings == [], printed
    assert report.log_lines == [], printed
    # every operation ran (the negative runs of the operations with neither parameters nor a body have no case)
    operations = {f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops}
    assert {label.rsplit(" [", 1)[0] for label in report.num_cases} == operations, printed
    assert len(report.num_cases) == 3 * len(operations), printed
    assert report.num_cases["POST /v1/completions [positive]"] >= MAX_EXAMPLES // 2, printed
    assert report.num_cases["PUT /admin/policy [coverage]"] == MAX_COVERAGE_CASES, printed
    assert report.total_cases >= 500, printed
