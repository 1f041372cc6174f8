"""The spec's window aggregation rules, one case each."""
import math

from grpo_agent.metrics import MetricWindow, reduction_for


def test_reduction_is_chosen_from_the_last_part_of_the_name():
    assert reduction_for("sample/dropped_stale_count") == "sum"
    assert reduction_for("tools/search/call_count") == "sum"
    assert reduction_for("completions/max_length") == "max"
    assert reduction_for("sample/staleness_max") == "max"
    assert reduction_for("clip_ratio/low_min") == "min"
    assert reduction_for("reward") == "mean"
    # "max" in an earlier part of the name does not count: only the last part decides.
    assert reduction_for("max_things/value") == "mean"


def test_window_sums_counts_keeps_extremes_and_averages_the_rest():
    w = MetricWindow()
    w.extend([("sample/dropped_stale_count", 2), ("sample/dropped_stale_count", 3)])
    w.extend([("completions/max_length", 10), ("completions/max_length", 7)])
    w.extend([("completions/min_length", 4), ("completions/min_length", 9)])
    w.extend([("reward", 1.0), ("reward", 0.0), ("reward", 0.5)])
    out = w.summarize()
    assert out["sample/dropped_stale_count"] == 5
    assert out["completions/max_length"] == 10
    assert out["completions/min_length"] == 4
    assert out["reward"] == 0.5


def test_rates_are_total_amount_over_total_seconds_not_a_mean_of_rates():
    w = MetricWindow()
    w.extend([("rollout/generated_tokens_per_s", (100.0, 1.0)),
              ("rollout/generated_tokens_per_s", (100.0, 3.0))])
    assert w.summarize()["rollout/generated_tokens_per_s"] == 50.0  # mean of rates would be 66.7


def test_summarize_starts_a_new_window_and_nan_stays_out_of_means():
    w = MetricWindow()
    w.add("tools/failure_frequency", math.nan)
    w.add("entropy", 2.0)
    w.add("entropy", math.nan)
    out = w.summarize()
    assert math.isnan(out["tools/failure_frequency"])
    assert out["entropy"] == 2.0
    assert w.summarize() == {}
    assert not w
