"""Parsing vLLM's `/metrics` text into the scheduler numbers the rollout loop uses."""
from grpo_agent.sampler.prometheus import parse_server_metrics

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 17.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.79e+09
process_open_fds 42
"""


def test_metrics_are_summed_over_engines_and_kv_usage_is_the_fullest():
    metrics = parse_server_metrics(VLLM_METRICS)
    assert (metrics.running, metrics.waiting, metrics.preemptions) == (20, 4, 12)
    assert metrics.kv_cache_usage == 0.5


def test_text_without_vllm_scheduler_metrics_gives_none():
    assert parse_server_metrics("process_open_fds 42\n") is None


def test_waiting_requests_and_preemptions_are_summed_over_engines():
    text = VLLM_METRICS + ('vllm:num_requests_waiting{engine="1",model_name="m"} 6.0\n'
                           'vllm:num_preemptions_total{engine="1",model_name="m"} 5.0\n')
    metrics = parse_server_metrics(text)
    assert (metrics.waiting, metrics.preemptions) == (10, 17)


def test_a_label_value_holding_a_brace_does_not_hide_the_sample_value():
    text = 'vllm:num_requests_running{engine="0",model_name="odd}name"} 7.0\n'
    assert parse_server_metrics(text).running == 7


def test_a_missing_kv_cache_usage_gauge_is_unknown_not_zero():
    text = "\n".join(line for line in VLLM_METRICS.splitlines() if "kv_cache_usage" not in line)
    metrics = parse_server_metrics(text)
    assert metrics.running == 20 and metrics.kv_cache_usage is None
