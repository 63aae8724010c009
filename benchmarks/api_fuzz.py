"""Property-based fuzzing of the gateway's HTTP API with schemathesis, against a live gateway over sim workers.

Not a speed figure: it prints case counts and findings. The gateway (``router.app.build_app``) and two sim workers
(``workers.server``, one publishing KV events) run on 127.0.0.1 in a background thread's event loop; schemathesis
reads ``GET /openapi.json`` (``router.openapi``) and, for every operation, sends its coverage phase (deterministic
cases: boundary values, each field missing, of a wrong type or out of range, undeclared methods, no
``Authorization``, a wrong content type), then positive cases (fit the schema) and negative ones (break it) drawn
by hypothesis, with the admin token (``requests``). Each answer is checked:

    not_a_gateway_5xx      no 5xx unless a worker answered it (the answer carries ``x-kvgate-worker``) or it is the
                           gateway's ``upstream_error`` for a worker that failed
    openai_error_shape     every 4xx/5xx is JSON ``{"error": {"message": str, "type": str, ...}}``
    schemathesis's own     status_code_conformance, content_type_conformance, response_headers_conformance,
                           response_schema_conformance, negative_data_rejection (a case that breaks the schema gets
                           a 4xx), unsupported_method (405), missing_required_header and ignored_auth (401 without
                           or with a wrong token)

and after the run the gateway's log must hold no traceback (no record with ``exc_info``, no ERROR from aiohttp's
server). Unknown query parameters and headers are not sent (the gateway ignores them, as the OpenAI API does).
Cases are kept to loopback: an added worker's ``url`` and ZMQ endpoints are rewritten to 127.0.0.1 ports where
nothing listens, and a routed completion (``model`` set to the served one, half of the positive cases) asks for at
most 8 tokens.

``python -m benchmarks api_fuzz --max-examples 200 --time-budget-s 600`` runs every coverage case and more examples
than the CI test (``tests/robustness/test_api_fuzz.py``: 40 coverage cases an operation, 8 examples a mode).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import requests
from aiohttp import web

from router.app import build_app
from router.config import parse_config
from router.openapi import OPENAPI_PATH

MODEL = "m"
BLOCK_SIZE = 16
TOKEN = "fuzz-token"
MAX_ROUTED_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LogCapture(logging.Handler):
    """Keeps every record with a traceback, and every ERROR or worse, logged by the gateway's process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)

    def lines(self) -> list[str]:
        return [f"{r.name} {r.levelname}: {r.getMessage()}" + (f" ({r.exc_info[1]!r})" if r.exc_info else "")
                for r in self.records]


@dataclass
class LiveFleet:
    """A gateway and two sim workers on loopback ports, served by a background thread's event loop."""

    url: str = ""
    dead_url: str = ""
    """An HTTP URL on 127.0.0.1 where nothing listens (added workers point there)."""
    log: LogCapture = field(default_factory=LogCapture)


async def _start(fleet: LiveFleet, ready: threading.Event, stop: asyncio.Event) -> None:
    from events.publisher import KVEventPublisher, PublisherConfig
    from workers.config import build_config
    from workers.server import build_app as build_worker_app
    from workers.server import build_worker

    runners: list[web.AppRunner] = []
    publisher = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", bind=True, linger_s=0.0,
                                                 replay_endpoint="tcp://127.0.0.1:*"))
    try:
        entries: list[dict[str, Any]] = []
        for worker_id, pub in (("w0", publisher), ("w1", None)):
            raw = {"worker-id": worker_id, "model": MODEL, "time-scale": 0.0,
                   "kv-cache": {"num-gpu-blocks": 256, "block-size": BLOCK_SIZE},
                   "scheduler": {"max-model-len": 8192, "max-num-batched-tokens": 8192, "default-max-tokens": 4}}
            runner = web.AppRunner(build_worker_app(build_worker(build_config(raw), pub)), access_log=None)
            await runner.setup()
            port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            entries.append({"id": worker_id, "url": f"http://127.0.0.1:{port}", "model": MODEL,
                            "events_endpoint": pub.endpoint if pub is not None else None,
                            "replay_endpoint": pub.replay_endpoint if pub is not None else None})
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "models": [{"name": MODEL, "block_size": BLOCK_SIZE, "default_max_tokens": 4}],
            "workers": entries, "policy": {"name": "cache_aware"}, "admin": {"token": TOKEN},
            "health": {"interval_s": 3600}, "load_poll": {"interval_s": 3600},
            "retry": {"max_retries": 1, "backoff_initial_s": 0.0},
            "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0}, "ready_timeout_s": 1})
        gateway = web.AppRunner(build_app(config), handler_cancellation=True)
        await gateway.setup()
        await web.TCPSite(gateway, "127.0.0.1", 0).start()
        runners.append(gateway)
        fleet.url = f"http://127.0.0.1:{gateway.addresses[0][1]}"
        fleet.dead_url = f"http://127.0.0.1:{_free_port()}"
        ready.set()
        await stop.wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        publisher.close()


@contextmanager
def live_fleet(timeout_s: float = 60.0) -> Iterator[LiveFleet]:
    """Start the fleet in a thread; yield once the gateway listens; stop and join it on exit.

    Raises:
        RuntimeError: the fleet did not start within ``timeout_s`` (the thread's error is chained).
    """
    fleet = LiveFleet()
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(_start(fleet, ready, stop))
        except BaseException as exc:  # reported by the waiting thread
            errors.append(exc)
            ready.set()
        finally:
            loop.close()

    root = logging.getLogger()
    root.addHandler(fleet.log)
    thread = threading.Thread(target=run, name="api-fuzz-fleet", daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout_s) or errors:
            raise RuntimeError("the fuzzed fleet did not start") from (errors[0] if errors else None)
        yield fleet
    finally:
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            thread.join(30.0)
        root.removeHandler(fleet.log)


# -- checks ----------------------------------------------------------------------------------------------------


def not_a_gateway_5xx(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 5xx is a finding unless a worker answered it or it is the gateway's ``upstream_error``."""
    if response.status_code < 500:
        return None
    if "x-kvgate-worker" in {k.lower() for k in response.headers}:
        return None
    try:
        error_type = msgspec.json.decode(response.content)["error"]["type"]
    except Exception:
        error_type = None
    if error_type == "upstream_error":
        return None
    raise AssertionError(f"the gateway answered {response.status_code}: {response.content[:300]!r}")


def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx is an OpenAI error object in JSON."""
    if response.status_code < 400:
        return None
    content_type = next((v for k, v in response.headers.items() if k.lower() == "content-type"), [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if not str(content_type).startswith("application/json"):
        raise AssertionError(f"a {response.status_code} answered as {content_type!r}: {response.content[:200]!r}")
    try:
        error = msgspec.json.decode(response.content)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
    except Exception as exc:
        raise AssertionError(f"a {response.status_code} that is no OpenAI error: {response.content[:200]!r}") from exc
    return None


# -- the run ---------------------------------------------------------------------------------------------------


@dataclass
class FuzzReport:
    """Cases sent per operation and mode, and the findings (``operation: message``; one a failing property)."""

    num_cases: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def total_cases(self) -> int:
        return sum(self.num_cases.values())


def _loopback_case(case: Any, dead_url: str, *, routed: bool) -> Any:
    """Keep ``case`` on 127.0.0.1 and bounded: workers it adds point at ``dead_url``; a routed completion names
    the served model and asks for at most ``MAX_ROUTED_TOKENS``."""
    body = case.body
    if not isinstance(body, dict):
        return case
    path = case.operation.path
    if path == "/admin/workers" and case.method.upper() == "POST":
        if "url" in body:
            body["url"] = dead_url
        for key in ("events_endpoint", "replay_endpoint"):
            if isinstance(body.get(key), str):
                body[key] = f"tcp://127.0.0.1:{_free_port()}"
    elif path.startswith("/v1/") and routed:
        body["model"] = MODEL
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = max(1, min(MAX_ROUTED_TOKENS, body[key]))
    return case


def _property(strategy: Any, fleet: LiveFleet, session: requests.Session, checks: list[Any], counter: list[int],
              *, routed_ok: bool, max_examples: int, seed: int) -> Any:
    """The hypothesis test of one operation and mode: draw a case, keep it on loopback, send it, check it."""
    import hypothesis
    from hypothesis import strategies as st

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=max_examples, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck),
                         phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink])
    @hypothesis.given(case=strategy, routed=st.booleans())
    def fuzz(case: Any, routed: bool) -> None:
        counter[0] += 1
        case = _loopback_case(case, fleet.dead_url, routed=routed and routed_ok)
        case.call_and_validate(base_url=fleet.url, session=session, checks=checks, timeout=30)

    return fuzz


def _coverage_cases(schema: Any, operation: Any) -> Iterator[Any]:
    """schemathesis's coverage phase for one operation: deterministic boundary cases, each field missing, of a
    wrong type or out of range, undeclared methods, a missing ``Authorization``, a wrong content type."""
    from schemathesis.generation import GenerationMode
    from schemathesis.generation.drivers import CoverageGenerator
    from schemathesis.generation.feedback import FeedbackSources
    from schemathesis.generation.overrides import Override

    yield from CoverageGenerator(
        operation=operation, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        generation_config=schema.config.generation_for(operation=operation, phase="coverage"), auth_storage=None,
        override=Override(), feedback=FeedbackSources())


def _finding(label: str, exc: BaseException) -> str:
    return f"{label}: {type(exc).__name__}: {str(exc)[:2000]}"


def run_fuzz(fleet: LiveFleet, *, max_examples: int, time_budget_s: float, seed: int = 0,
             max_coverage_cases: int | None = None) -> FuzzReport:
    """Fuzz every operation of the fleet's gateway: the coverage phase, then positive and negative cases.

    Args:
        fleet: a running ``live_fleet``.
        max_examples: hypothesis examples per operation and mode.
        time_budget_s: no new operation starts after this many seconds (the one running finishes).
        seed: hypothesis seed (runs are reproducible for one schema).
        max_coverage_cases: coverage cases sent per operation (the first ones; ``None``: all of them).

    Returns:
        The report; ``findings`` empty when every check held (one per failing property, one per distinct coverage
        failure of an operation).
    """
    import hypothesis
    import schemathesis
    from schemathesis.checks import not_a_server_error  # noqa: F401  (registers the built-in checks)
    from schemathesis.config._auth import OpenAPIAuthConfig
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        missing_required_header,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
        unsupported_method,
    )

    checks = [not_a_gateway_5xx, openai_error_shape, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance, negative_data_rejection,
              unsupported_method, missing_required_header, ignored_auth]
    document = requests.get(fleet.url + OPENAPI_PATH, timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    # Unknown query parameters and headers are ignored, as by the OpenAI API: not a case to expect a 4xx for.
    schema.config.generation.update(allow_extra_parameters=False)
    schema.config.auth.openapi = OpenAPIAuthConfig(schemes={"adminToken": {"bearer": TOKEN}})
    report = FuzzReport()
    start_s = time.monotonic()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # our own document: every operation loads
        if time.monotonic() - start_s > time_budget_s:
            break
        label = f"{operation.method.upper()} {operation.path}"
        seen: set[str] = set()
        num_sent = 0
        for i, case in enumerate(_coverage_cases(schema, operation)):
            if max_coverage_cases is not None and i >= max_coverage_cases:
                break
            num_sent += 1
            case = _loopback_case(case, fleet.dead_url, routed=i % 2 == 0 and case.meta.generation.mode.is_positive)
            try:
                case.call_and_validate(base_url=fleet.url, session=session, checks=checks, timeout=30)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                first_line = str(exc).strip().split("\n")[0]
                if first_line not in seen:
                    seen.add(first_line)
                    report.findings.append(_finding(f"{label} [coverage]", exc))
        report.num_cases[f"{label} [coverage]"] = num_sent
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)
            counter = [0]
            fuzz = _property(strategy, fleet, session, checks, counter, routed_ok=mode is GenerationMode.POSITIVE,
                             max_examples=max_examples, seed=seed)
            try:
                fuzz()
            except hypothesis.errors.Unsatisfiable:  # nothing to break: no parameter, no body
                pass
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # a failing property: schemathesis's FailureGroup (an exception group)
                report.findings.append(_finding(f"{label} [{mode.value}]", exc))
            report.num_cases[f"{label} [{mode.value}]"] = counter[0]
    report.wall_s = time.monotonic() - start_s
    report.log_lines = fleet.log.lines()
    return report


def print_report(report: FuzzReport) -> None:
    print(f"api fuzz: {report.total_cases} cases over {len(report.num_cases)} operation x phase runs "
          f"in {report.wall_s:.1f} s; {len(report.findings)} findings; "
          f"{len(report.log_lines)} gateway log records with a traceback or at ERROR")
    for label, n in report.num_cases.items():
        print(f"  {n:6d}  {label}")
    for finding in report.findings:
        print("FINDING", finding)
    for line in report.log_lines:
        print("LOG", line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks api_fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=100, help="examples per operation and mode")
    parser.add_argument("--time-budget-s", type=float, default=600.0, help="no operation starts after this")
    parser.add_argument("--max-coverage-cases", type=int, default=None,
                        help="coverage-phase cases per operation (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_examples < 1:
        parser.error("--max-examples must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    with live_fleet() as fleet:
        report = run_fuzz(fleet, max_examples=args.max_examples, time_budget_s=args.time_budget_s, seed=args.seed,
                          max_coverage_cases=args.max_coverage_cases)
    print_report(report)
    return 1 if report.findings or report.log_lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
