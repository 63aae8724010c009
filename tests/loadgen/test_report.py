import json

import pytest

from loadgen.report import imbalance, markdown_table, percentile, simulated_ttft_s, summarize

from .builders import make_record

pytestmark = pytest.mark.unit


def test_summary_on_known_records():
    records = [
        make_record(0, worker="w0", prompt=100, cached=0, predicted=0, ttft=0.1, itl=(0.01, 0.03)),
        make_record(1, worker="w1", prompt=300, cached=200, predicted=200, ttft=0.2, itl=(0.02,)),
        make_record(2, worker="w0", prompt=200, cached=100, predicted=96, ttft=0.3),
        make_record(3, worker="w1", prompt=400, cached=400, predicted=None, ttft=0.4),
        make_record(4, error="http_503", prompt=999, cached=999),
        make_record(5, error="connect"),
        make_record(6, error="connect"),
    ]
    s = summarize(
        records, policy="p", ceiling_hit_ratio=0.8, duration_s=10.0, time_scale=2.0, workers=["w0", "w1", "w2"]
    )
    assert (s.requests_ok, s.requests_failed) == (4, 3)
    assert s.errors_by_kind == {"http_503": 1, "connect": 2}
    assert s.num_prompt_tokens == 1000 and s.num_cached_tokens == 700
    assert s.hit_ratio == pytest.approx(0.7)
    assert s.fraction_of_ceiling == pytest.approx(0.875)
    # times scaled by 2: TTFTs 0.2, 0.4, 0.6, 0.8
    assert s.ttft_p50_s == pytest.approx(0.5)
    assert s.ttft_p99_s == pytest.approx(0.6 + 0.97 * 0.2)
    assert s.itl_p50_s == pytest.approx(0.04)
    assert s.output_tokens_per_s == pytest.approx(16 / 20.0)
    assert s.requests_by_worker == {"w0": 2, "w1": 2, "w2": 0}
    assert s.prompt_tokens_by_worker == {"w0": 300, "w1": 700, "w2": 0}
    assert s.load_imbalance == pytest.approx(700 / (1000 / 3))
    assert s.request_imbalance == pytest.approx(2 / (4 / 3))
    # three requests carry a prediction; one of them (96 vs 100) differs
    assert s.cached_tokens_mismatch_ratio == pytest.approx(1 / 3)
    assert s.num_unpredicted == 1
    assert s.duration_s == 20.0


def test_helpers_and_empty_run():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert imbalance([]) is None and imbalance([0, 0]) is None
    assert imbalance([1, 1, 4]) == 2.0
    s = summarize([], policy="empty", ceiling_hit_ratio=0.0, duration_s=0.0)
    assert (s.requests_ok, s.hit_ratio, s.ttft_p50_s, s.fraction_of_ceiling) == (0, 0.0, None, None)
    with pytest.raises(ValueError, match="time_scale"):
        summarize([], policy="x", ceiling_hit_ratio=0.0, duration_s=1.0, time_scale=0.0)


def test_markdown_table_rows():
    a = summarize([make_record(0, cached=50, predicted=50)], policy="cache_aware", ceiling_hit_ratio=0.5, duration_s=1)
    b = summarize([make_record(0, error="timeout")], policy="round_robin", ceiling_hit_ratio=0.5, duration_s=1)
    text = markdown_table([a, b])
    lines = text.splitlines()
    assert lines[0].startswith("| run | ok | failed | not sent | hit ratio | of ceiling |")
    assert lines[2].startswith("| cache_aware | 1 | 0 | 0 | 0.500 | 1.00 | 0.100 |")
    assert lines[3].startswith("| round_robin | 0 | 1 | 0 | 0.000 | 0.00 | – |")
    assert lines[5] == (
        "Ceiling hit ratio (infinite cache) over the requests that succeeded, as `hit ratio`: 0.500 (failed and "
        "unsent requests neither read nor fill that cache). Times in wall seconds (time scale 1)."
    )
    assert lines[6] == "Errors by kind: round_robin: {'timeout': 1}."
    json.dumps(a.errors_by_kind)


def test_markdown_caption_per_run_ceilings_and_simulated_seconds():
    a = summarize([make_record(0, cached=50)], policy="cache_aware", ceiling_hit_ratio=0.5, duration_s=1, time_scale=5)
    b = summarize([make_record(0, cached=20)], policy="round_robin", ceiling_hit_ratio=0.25, duration_s=1, time_scale=5)
    assert markdown_table([a, b]).splitlines()[5] == (
        "Ceiling hit ratio (infinite cache) over the requests that succeeded, as `hit ratio`: cache_aware 0.500, "
        "round_robin 0.250 (failed and unsent requests neither read nor fill that cache). "
        "Times in simulated seconds (wall seconds × time scale 5)."
    )


def test_mismatch_column_is_a_percentage():
    records = [make_record(i, cached=16, predicted=0 if i == 0 else 16) for i in range(60)]
    s = summarize(records, policy="run", ceiling_hit_ratio=0.5, duration_s=1)
    assert s.cached_tokens_mismatch_ratio == 1 / 60
    assert markdown_table([s]).splitlines()[2].endswith("| 1.67% |")


def test_plot_time_axes_say_wall_seconds_at_time_scale_1():
    from loadgen.plots import RunRecords, _seconds_label

    assert _seconds_label([RunRecords("a", []), RunRecords("b", [])]) == "s"
    assert _seconds_label([RunRecords("a", []), RunRecords("b", [], time_scale=5.0)]) == "simulated s"


def test_markdown_table_names_the_requests_not_sent():
    records = [make_record(0), make_record(1), make_record(2, error="timeout")]
    cut = summarize(
        records, policy="cut", ceiling_hit_ratio=0.5, duration_s=1, num_skipped=7, skip_reason="max_duration_s"
    )
    whole = summarize(records, policy="whole", ceiling_hit_ratio=0.5, duration_s=1)
    assert (cut.num_skipped, cut.skip_reason, whole.num_skipped, whole.skip_reason) == (7, "max_duration_s", 0, None)
    lines = markdown_table([cut, whole]).splitlines()
    assert lines[2].startswith("| cut | 2 | 1 | 7 | ")
    assert lines[3].startswith("| whole | 2 | 1 | 0 | ")
    # one line for the run that left requests unsent, none for the other; its numbers are the summary's
    assert lines[6:] == [
        "cut: 10 requests, 2 ok, 1 failed, 7 not sent (max-duration-s reached).",
        "Errors by kind: cut: {'timeout': 1}; whole: {'timeout': 1}.",
    ]
    with pytest.raises(ValueError, match="skip_reason"):
        summarize(records, policy="x", ceiling_hit_ratio=0.5, duration_s=1, num_skipped=1)
    with pytest.raises(ValueError, match="num_skipped"):
        summarize(records, policy="x", ceiling_hit_ratio=0.5, duration_s=1, num_skipped=-1)


def test_only_the_engines_part_of_the_ttft_is_scaled():
    # TTFT 0.3 s at the client of which the engine took 0.1 s: at time scale 5, 0.1 * 5 + 0.2 = 0.7 simulated s.
    with_engine = make_record(0, ttft=0.3)
    with_engine.engine_ttft_s = 0.1
    without = make_record(1, ttft=0.3)
    inconsistent = make_record(2, ttft=0.3)
    inconsistent.engine_ttft_s = 0.4  # longer than the client's TTFT: not trusted, the whole is scaled
    assert simulated_ttft_s(with_engine, 5.0) == pytest.approx(0.7)
    assert simulated_ttft_s(without, 5.0) == pytest.approx(1.5)
    assert simulated_ttft_s(inconsistent, 5.0) == pytest.approx(1.5)
    assert simulated_ttft_s(make_record(3, error="connect", ttft=None), 5.0) is None
    s = summarize([with_engine, without], policy="p", ceiling_hit_ratio=0.5, duration_s=1.0, time_scale=5.0)
    assert s.ttft_p50_s == pytest.approx((0.7 + 1.5) / 2)
    assert s.ttft_outside_engine_p50_s == pytest.approx(0.2)


def test_plots_of_a_run_where_every_request_failed_warn_nothing(tmp_path):
    """A replay against a URL that is down (every request `connect`) writes its three plots without a warning."""
    import warnings

    from loadgen.plots import RunRecords, write_plots

    run = RunRecords("run", [make_record(i, error="connect") for i in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_plots([run], tmp_path)
    assert [p.name for p in paths] == ["ttft_cdf.png", "hit_ratio_over_time.png", "worker_load_over_time.png"]
    assert all(p.stat().st_size > 0 for p in paths)
