"""``benchmarks.routing``: where the agentic sessions are found without ``--trace``, and the error when they are not."""

import argparse
from pathlib import Path

import pytest

from benchmarks.routing import add_arguments, find_agentic_traces, load_workload

pytestmark = pytest.mark.unit


def _traces(root: Path) -> Path:
    directory = root / "shared" / "traces" / "kv-cache-tester"
    directory.mkdir(parents=True)
    (directory / "trace_0001.json").write_text("{}", encoding="utf-8")
    return directory


def test_the_traces_beside_the_checkout_or_above_it_are_found(tmp_path):
    beside = _traces(tmp_path / "a")
    assert find_agentic_traces(tmp_path / "a" / "kvgate") == beside  # ../shared beside the checkout
    assert find_agentic_traces(tmp_path / "a" / "wt" / "route") == beside  # a worktree one level deeper
    nearer = _traces(tmp_path / "a" / "wt")
    assert find_agentic_traces(tmp_path / "a" / "wt" / "route") == nearer


def test_a_directory_without_trace_files_is_passed_over(tmp_path):
    (tmp_path / "a" / "wt" / "shared" / "traces" / "kv-cache-tester").mkdir(parents=True)
    beside = _traces(tmp_path / "a")
    assert find_agentic_traces(tmp_path / "a" / "wt" / "route") == beside


def test_no_traces_fails_naming_the_flag_and_where_it_looked(tmp_path):
    with pytest.raises(SystemExit) as info:
        find_agentic_traces(tmp_path / "b" / "route")
    message = str(info.value.code)
    assert message.startswith("no agentic traces: pass --trace DIR")
    assert str(tmp_path / "b" / "shared" / "traces" / "kv-cache-tester") in message


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_missing_trace_flag_path_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match=r"^--trace .*nowhere: no such file or directory$"):
        load_workload(_args("--workload", "agentic", "--trace", str(tmp_path / "nowhere")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"^--trace: .*no session files found"):
        load_workload(_args("--workload", "agentic", "--trace", str(empty)))
