"""Benchmark command lines refuse counts that would leave nothing to measure, with a clear message."""

import pytest

import benchmarks.gateway
import benchmarks.worker

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("flag", ["--wall-repeats", "--wall-requests", "--wall-concurrency", "--repeats", "--steps"])
def test_worker_bench_refuses_non_positive_counts(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        benchmarks.worker.main([flag, "0"])
    assert exc.value.code == 2
    assert f"{flag} must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rounds", "--requests", "--concurrency", "--num-workers"])
def test_gateway_bench_refuses_non_positive_counts(flag, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["benchmarks.gateway", flag, "0"])
    with pytest.raises(SystemExit) as exc:
        benchmarks.gateway.main()
    assert exc.value.code == 2
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_instruction_counts_need_valgrind(capsys, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr("sys.argv", ["benchmarks.gateway", "--instructions"])
    with pytest.raises(SystemExit) as exc:
        benchmarks.gateway.main()
    assert exc.value.code == 2
    assert "needs valgrind" in capsys.readouterr().err


def test_benchmark_runner_lists_every_benchmark_module(capsys):
    from pathlib import Path

    import benchmarks
    import benchmarks.__main__

    modules = {path.stem for path in Path(benchmarks.__file__).parent.glob("*.py") if not path.stem.startswith("_")}
    assert set(benchmarks.NAMES) == modules
    assert benchmarks.__main__.main([]) == 2
    assert benchmarks.__main__.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err
    assert ", ".join(benchmarks.NAMES) in err and "soak, chaos" in err


def test_benchmark_runner_passes_the_flags_on(capsys, monkeypatch):
    import benchmarks.__main__

    monkeypatch.setattr("sys.argv", ["benchmarks"])
    with pytest.raises(SystemExit) as exc:
        benchmarks.__main__.main(["worker", "--steps", "0"])
    assert exc.value.code == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
