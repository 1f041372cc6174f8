"""`tools/*` metrics are logged only when the trainer has tools (the spec's rule), though the
tool loop counts calls either way."""
from __future__ import annotations

import asyncio

from grpo_agent.metrics import MetricWindow
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.rollout.observations import completion_observations
from test_tool_loop import call, multiply


def rollout_of(loop, tools):
    prompt = [{"role": "user", "content": "What is 3 times 4?"}]
    return asyncio.run(run_tool_loop(loop, prompt, list(tools), group_id=0))


def test_no_tools_means_no_tools_metrics(scripted_loop):
    rollouts = [rollout_of(scripted_loop(["It is 12."]), []) for _ in range(2)]
    assert "tools/call_frequency" in rollouts[0].metrics  # counted by the loop...
    names = {name for name, _ in completion_observations(rollouts, with_tools=False)}
    assert "completions/mean_length" in names
    assert sorted(n for n in names if n.startswith("tools/")) == []  # ...but not logged


def test_with_tools_every_tools_metric_is_logged_with_its_value(scripted_loop):
    rollouts = [rollout_of(scripted_loop([call("multiply", a=3, b=4), "It is 12."]), [multiply]),
                rollout_of(scripted_loop(["It is 12."]), [multiply])]
    window = MetricWindow()
    window.extend(completion_observations(rollouts, with_tools=True))
    tools = {k: v for k, v in window.summarize().items() if k.startswith("tools/")}
    assert tools.pop("tools/latency_s") >= 0 and tools.pop("tools/multiply/latency_s") >= 0
    assert tools == {
        "tools/call_frequency": 0.5,  # one call over two rollouts
        "tools/failure_frequency": 0.0,
        "tools/parallel_calls_mean": 1.0,
        "tools/unknown_name_count": 0.0,
        "tools/malformed_call_count": 0.0,
        "tools/loop_exhausted_frac": 0.0,
        "tools/multiply/call_count": 1.0,
        "tools/multiply/failure_count": 0.0,
    }
