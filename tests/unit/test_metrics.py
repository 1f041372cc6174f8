"""The spec's window aggregation rules, one case each, and every documented metric's reduction."""
import itertools
import math
import re
from pathlib import Path

import pytest
from grpo_agent.metrics import MetricWindow, reduction_for

METRICS_MD = Path(__file__).parents[2] / "docs" / "metrics.md"


def test_reduction_is_chosen_from_the_last_part_of_the_name():
    assert reduction_for("sample/dropped_stale_count") == "sum"
    assert reduction_for("tools/search/call_count") == "sum"
    assert reduction_for("completions/max_length") == "max"
    assert reduction_for("sample/staleness_max") == "max"
    assert reduction_for("clip_ratio/low_min") == "min"
    assert reduction_for("reward") == "mean"
    # "max" in an earlier part of the name does not count: only the last part decides.
    assert reduction_for("max_things/value") == "mean"
    # Whole words only: "terminated" holds "min", "maximal" holds "max", "counter" holds "count".
    assert reduction_for("completions/mean_terminated_length") == "mean"
    assert reduction_for("x/maximal_gain") == "mean"
    assert reduction_for("env/counter_value") == "mean"
    assert reduction_for("rollout/generated_tokens_per_s") == "rate"


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


def test_a_rate_observed_as_plain_values_is_refused():
    with pytest.raises(ValueError, match="add_rate"):
        MetricWindow().add("perf/wall_clock_trained_tokens_per_s", 10.0)


# Every metric docs/metrics.md names, with the reduction the spec's window rule gives it.
EXPECTED_REDUCTIONS = {
    "loss": "mean", "num_tokens": "mean", "reward": "mean", "reward_kept": "mean", "reward_dropped": "mean",
    "reward_group_std": "mean", "frac_reward_zero_std": "mean", "entropy": "mean",
    "aux_loss": "mean",
    "rewards/{name}/mean": "mean", "rewards/{name}/group_std": "mean",
    "completions/mean_length": "mean", "completions/min_length": "min",
    "completions/max_length": "max", "completions/mean_terminated_length": "mean",
    "completions/min_terminated_length": "min", "completions/max_terminated_length": "max",
    "completions/clipped_ratio": "mean", "completions/duplicate_frac": "mean",
    "sampling/sampling_logp_difference/mean": "mean",
    "sampling/sampling_logp_difference/max": "max",
    "sampling/importance_sampling_ratio/min": "min",
    "sampling/importance_sampling_ratio/mean": "mean",
    "sampling/importance_sampling_ratio/max": "max",
    "sampling/masked_mean": "mean", "sampling/sampler_mass": "mean",
    "clip_ratio/region_mean": "mean", "clip_ratio/low_mean": "mean", "clip_ratio/low_min": "min",
    "clip_ratio/high_mean": "mean", "clip_ratio/high_max": "max",
    "rollout/duration_s": "mean", "rollout/generated_tokens_per_s": "rate",
    "rollout/concurrency": "mean", "rollout/concurrency_cap": "mean",
    "rollout/turns_mean": "mean", "rollout/turns_max": "max", "rollout/context_full_frac": "mean",
    "rollout/samples_per_rollout": "mean", "rollout/fork_frac": "mean",
    "rollout/drift_tokens_mean": "mean", "rollout/drift_tokens_max": "max",
    "rollout/score_queue_size": "mean", "rollout/queue_size": "mean", "rollout/score_s": "mean",
    "rollout/score_wait_s": "mean", "rollout/score_block_s": "mean",
    "rollout/backpressure_s": "mean", "rollout/vllm_retry_count": "sum",
    "rollout/vllm_kv_cache_usage_frac": "mean", "rollout/vllm_running_requests": "mean",
    "rollout/vllm_queued_requests": "mean", "rollout/vllm_preemption_count": "sum",
    "rollout/reward_error_count": "sum", "rollout/stalled_group_count": "sum",
    "rollout/server_lost_group_count": "sum", "server/restart_count": "sum",
    "rollout/staleness_window_frac": "mean",
    "rollout/prompt_too_long_group_count": "sum", "rollout/env_error_group_count": "sum",
    "tools/call_frequency": "mean", "tools/failure_frequency": "mean", "tools/latency_s": "mean",
    "tools/{tool}/latency_s": "mean", "tools/{tool}/call_count": "sum",
    "tools/{tool}/failure_count": "sum", "tools/{tool}/cancelled_count": "sum",
    "tools/unknown_name_count": "sum",
    "tools/malformed_call_count": "sum", "tools/parallel_calls_mean": "mean",
    "tools/loop_exhausted_frac": "mean", "env/reset_s": "mean", "env/reward_s": "mean",
    "env/late_call_unscored_count": "sum",
    "harness/calls_per_rollout": "mean", "harness/errors_count": "sum", "harness/timeout_count": "sum",
    "harness/rejected_calls_count": "sum", "harness/dropped_frac": "mean",
    "sample/forwarded_tokens_mean": "mean", "sample/forwarded_tokens_max": "max",
    "sample/trained_tokens_mean": "mean", "sample/time_in_queue_s": "mean",
    "sample/staleness_mean": "mean", "sample/staleness_max": "max",
    "sample/dropped_stale_count": "sum",
    "batch/forwarded_tokens_per_step": "mean", "batch/trained_tokens_per_step": "mean",
    "batch/samples_per_step": "mean", "batch/groups_per_step": "mean",
    "batch/microbatches_per_step": "mean", "batch/masked_token_frac": "mean",
    "batch/samples_per_row": "mean", "batch/row_tokens_mean": "mean",
    "batch/row_tokens_max": "max", "batch/row_fill_frac": "mean", "batch/row_imbalance": "mean",
    "batch/packing_ratio": "mean", "batch/pad_frac": "mean",
    "batch/dropped_oversize_count": "sum", "optimizer/skipped_step_count": "sum",
    "perf/step_s": "mean", "perf/fwd_bwd_s": "mean", "perf/fwd_s": "mean",
    "perf/optimizer_s": "mean", "perf/rollout_wait_s": "mean", "perf/weight_sync_s": "mean",
    "perf/weight_sync_pause_s": "mean", "perf/weight_sync_barrier_s": "mean",
    "perf/weight_sync_transfer_s": "mean", "perf/fwd_bwd_forwarded_tokens_per_s": "rate",
    "perf/wall_clock_forwarded_tokens_per_s": "rate",
    "perf/wall_clock_trained_tokens_per_s": "rate", "perf/fwd_bwd_mfu": "mean",
    "perf/wall_clock_mfu": "mean", "perf/eval_push_wait_s": "mean",
    "eval/reward": "mean", "eval/rewards/{name}/mean": "mean", "eval/pass@1": "mean",
    "eval/pass@{k}": "mean", "eval/completions/mean_length": "mean", "eval/model_version": "mean",
    "eval/step": "mean", "eval/duration_s": "mean", "eval/num_rows": "mean",
    "eval/reward_error_count": "sum", "stop/window_steps": "mean",
}


def documented_metric_names() -> set[str]:
    """Backticked names with a '/' in docs/metrics.md, `{a,b}` alternatives expanded, plus the
    top-level names of EXPECTED_REDUCTIONS the page mentions."""
    spans = set(re.findall(r"`([^`]+)`", METRICS_MD.read_text()))
    names = {name for name in EXPECTED_REDUCTIONS if "/" not in name and name in spans}
    for span in spans:
        if "/" not in span or " " in span or "*" in span:
            continue
        parts = re.split(r"\{([^{}]*,[^{}]*)\}", span)  # odd parts: comma alternatives
        choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
        names.update("".join(c) for c in itertools.product(*choices))
    return names


# transformers' own keys of a logged row, which docs/metrics.md names in its prose.
TRAINER_KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "step", "train_runtime",
                "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")
# A logged name's run-specific part (a reward source, a tool, k) -> the page's placeholder.
PLACEHOLDERS = [(re.compile(r"^(eval/)?rewards/[^/]+/"), r"\1rewards/{name}/"),
                (re.compile(r"^tools/[^/]+/(?=latency_s$|call_count$|failure_count$|cancelled_count$)"), "tools/{tool}/"),
                (re.compile(r"^eval/pass@(?!1$)\d+$"), "eval/pass@{k}")]


def undocumented(logged: set[str]) -> list[str]:
    """The names of a real run's metrics.jsonl rows that docs/metrics.md does not document."""
    spans = set(re.findall(r"`([^`]+)`", METRICS_MD.read_text()))
    documented = documented_metric_names() | (set(TRAINER_KEYS) & spans)
    def placeheld(name: str) -> str:
        for pattern, placeholder in PLACEHOLDERS:
            name = pattern.sub(placeholder, name)
        return name
    return sorted(name for name in logged if placeheld(name) not in documented)


def test_undocumented_maps_run_specific_parts_to_the_pages_placeholders():
    logged = {"rewards/letter_fraction/mean", "eval/rewards/CounterEnv/mean", "eval/pass@4",
              "tools/increment/call_count", "tools/call_frequency", "grad_norm", "train_runtime",
              "rewards/x/made_up", "made_up/name", "made_up"}
    assert undocumented(logged) == ["made_up", "made_up/name", "rewards/x/made_up"]


def test_every_documented_metric_has_the_reduction_the_spec_rule_gives_it():
    documented = documented_metric_names()
    assert documented == set(EXPECTED_REDUCTIONS), (
        "docs/metrics.md and this table disagree; documented only: "
        f"{sorted(documented - set(EXPECTED_REDUCTIONS))}, "
        f"expected only: {sorted(set(EXPECTED_REDUCTIONS) - documented)}")
    wrong = {name: reduction_for(name) for name, kind in EXPECTED_REDUCTIONS.items()
             if reduction_for(name) != kind}
    assert wrong == {}


def test_the_window_reduces_a_terminated_length_as_a_mean():
    w = MetricWindow()
    for length in (3, 10, 20):
        w.add("completions/mean_terminated_length", length)
    assert w.summarize()["completions/mean_terminated_length"] == 11.0  # min would give 3


def test_only_a_name_ending_in_the_word_per_s_is_a_rate():
    """`_per_s` is a word of its own: a last part merely ending in "per_s" is a mean."""
    assert reduction_for("x/stopper_s") == "mean"
    MetricWindow().add("x/stopper_s", 1.0)  # a plain value, not refused as a rate


def test_a_window_holding_only_rates_is_not_empty_and_summarize_starts_its_rates_anew():
    """Rates count as observations (a window of rates only is logged), and each window's rate
    is its own amount over its own seconds, not carried over into the next window."""
    w = MetricWindow()
    w.add_rate("rollout/generated_tokens_per_s", 100.0, 2.0)
    assert w
    assert w.summarize() == {"rollout/generated_tokens_per_s": 50.0}
    assert not w
    w.add_rate("rollout/generated_tokens_per_s", 30.0, 1.0)
    assert w.summarize() == {"rollout/generated_tokens_per_s": 30.0}  # carried over: 43.3


def test_a_rate_over_no_time_is_nan_not_zero_and_a_nan_count_is_left_out_of_the_sum():
    w = MetricWindow()
    w.add_rate("rollout/generated_tokens_per_s", 0.0, 0.0)
    w.extend([("sample/dropped_stale_count", 2), ("sample/dropped_stale_count", math.nan)])
    out = w.summarize()
    assert math.isnan(out["rollout/generated_tokens_per_s"])  # unknown, not a rate of 0
    assert out["sample/dropped_stale_count"] == 2.0
