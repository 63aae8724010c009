"""``benchmarks.long_turns``'s event-loop part takes the gateway's view path: a prompt over
``router.api.OFF_LOOP_PLAN_CHARS`` is planned off the loop, a shorter one on it."""

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks.long_turns import _body, _loop_point
from router.api import OFF_LOOP_PLAN_CHARS

pytestmark = pytest.mark.unit


class _RecordingTokenizer:
    """Records each ``view_async`` call's prompt length and ``plan_off_loop``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    async def view_async(self, parsed, off_loop_chars=0, *, plan_off_loop=False):
        self.calls.append((len(parsed.prompt), plan_off_loop))
        return SimpleNamespace(block_hashes=(7,))


class _NullIndex:
    def __init__(self):
        self.sliced_inserts = {}

    def match(self, block_hashes):
        return None

    def insert_approximate(self, worker_id, block_hashes, now_s, dp_rank=0, ttl_s=None, max_new_blocks=None):
        return None


def test_a_huge_prompt_is_planned_off_the_loop_as_in_the_gateway():
    tokenizer = _RecordingTokenizer()
    huge, edge = "x" * (OFF_LOOP_PLAN_CHARS + 1), "y" * OFF_LOOP_PLAN_CHARS
    first, following, _ = asyncio.run(
        _loop_point(tokenizer, _NullIndex(), "completions", [[_body(edge, False), _body(huge, False)]]))
    assert tokenizer.calls == [(OFF_LOOP_PLAN_CHARS, False), (OFF_LOOP_PLAN_CHARS + 1, True)]
    assert (len(first), len(following)) == (1, 1)


def test_the_lag_probe_splits_each_lateness_into_cpu_run_queue_and_gil():
    from benchmarks._loop_probe import LagProbe

    probe = LagProbe()
    probe._fd = 3  # as if schedstat had been read
    # (wall, loop thread CPU, loop thread run-queue wait, process CPU), seconds
    probe._samples = [(0.0, 0.0, 0.0, 0.0), (0.0015, 0.0002, 0.0001, 0.0003), (0.0125, 0.0022, 0.0061, 0.0203),
                      (0.0205, 0.0222, 0.0061, 0.0403)]
    assert probe.lags_s == pytest.approx([0.0005, 0.010, 0.007], abs=1e-12)
    s = probe.summary()
    assert (s.max_s, s.p99_s, s.num_samples) == (pytest.approx(0.010, abs=1e-12), pytest.approx(0.010, abs=1e-12), 3)
    # the worst interval: 11 ms of wall, 1 asked for; 2 ms on CPU, 6 ms runnable without a core, 2 ms for the GIL
    assert (s.worst_cpu_s, s.worst_run_queue_s, s.worst_blocked_s) == pytest.approx((0.002, 0.006, 0.002), abs=1e-12)
    assert s.worst_process_cores == pytest.approx(0.020 / 0.011, abs=1e-12)  # the process: 20 ms of CPU in 11 ms
    assert s.split() == "2.0/6.0/2.0 1.8"
    # over 5 ms: the 10 ms and the 7 ms intervals (the latter's 20 ms of CPU is cut to its 7 ms of lateness)
    assert (s.over_s, s.over_cpu_s, s.over_run_queue_s, s.over_blocked_s) == pytest.approx(
        (0.017, 0.009, 0.006, 0.002), abs=1e-12)
    assert s.over_split() == "17 53%/35%/12%"


def test_the_lag_probe_refuses_a_run_without_an_interval():
    from benchmarks._loop_probe import LagProbe

    probe = LagProbe()
    probe._samples = [(0.0, 0.0, 0.0, 0.0)]
    with pytest.raises(ValueError, match="no interval"):
        probe.summary()


def test_the_step_timer_names_the_step_that_used_the_most_cpu():
    import time

    from benchmarks.long_turns import _StepTimer

    async def busy_then_wait() -> None:
        await asyncio.sleep(0)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:  # 20 ms of CPU in one step
            pass
        await asyncio.sleep(0.001)

    async def run() -> tuple[float, str]:
        timer = _StepTimer()
        timer.start()
        await asyncio.gather(busy_then_wait(), asyncio.sleep(0.002))
        _, _, max_cpu_s, name = timer.stop()
        return max_cpu_s, name

    max_cpu_s, name = asyncio.run(run())
    assert max_cpu_s >= 0.02
    assert name.startswith("busy_then_wait:")  # the coroutine, at the line it suspended after the step
    assert name.split(">")[1].startswith("sleep:")


@pytest.mark.parametrize(("argv", "message"), [
    (["--kinds", "text,foo"], "--kinds: text and/or chat, got text,foo"),
    (["--switch-interval-s", "0"], "--switch-interval-s must be positive, got 0.0"),
    (["--prompt-cache-mib", "0"], "--prompt-cache-mib must be at least 1, got 0"),
])
def test_bad_options_are_refused_by_name_before_anything_runs(argv, message, capsys):
    from benchmarks.long_turns import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_spawn_puts_env_over_this_processs_environment(tmp_path, monkeypatch):
    import sys

    from benchmarks.gateway import _spawn

    monkeypatch.setenv("KVGATE_TEST_KEPT", "kept")
    out = tmp_path / "env.txt"
    script = (f"import os; open({str(out)!r}, 'w').write(os.environ['KVGATE_TEST_KEPT'] + ' ' + "
              "os.environ['PYTHONMALLOC'])")
    assert _spawn([sys.executable, "-c", script], env={"PYTHONMALLOC": "malloc"}).wait(30) == 0
    assert out.read_text() == "kept malloc"
