"""Installed environment plugins (found through real entry points) work through the tool loop."""
from __future__ import annotations

import asyncio
import json

from grpo_agent.plugins import load_environment, load_registry
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.rollout.environments import EnvironmentRunner


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def rollout_with(loop, env_name: str, row: dict, script):
    """Start an env episode, let `script(env)` decide the turns, run the loop, score it."""

    async def go():
        runner = EnvironmentRunner(load_registry().resolve_environment(env_name), loop.tool_executor)
        episode = await runner.start(row)
        loop._texts = script(episode.env)
        rollout = await run_tool_loop(loop, episode.prompt, episode.tools, group_id=0)
        return episode, rollout, await runner.finish(episode)

    return asyncio.run(go())


def test_counter_env_tools_run_through_the_tool_loop(scripted_loop):
    loop = scripted_loop([])
    episode, rollout, (source, reward) = rollout_with(
        loop, "counter", {}, lambda env: [call("increment", step=env.target), "Done."]
    )
    assert source.__name__ == "CounterEnv" and reward == 1.0
    assert rollout.tool_call_count == 1 and rollout.tool_failure_count == 0
    assert json.loads(rollout.completion[1]["content"]) == episode.env.target


def test_counter_rewards_only_reaching_the_target_exactly():
    env = load_environment("counter")()
    env.reset(target=4)
    env.increment(3)
    assert env.get_reward() == 0.0
    env.increment(1)
    assert env.get_reward() == 1.0
    env.increment(100)  # overshooting is no solution
    assert env.get_reward() == 0.0


def test_counter_evaluates_every_target_once_and_counts_reward_1_as_solved():
    spec = load_environment("counter")
    assert spec.load_dataset() is None  # training samples its targets in reset
    assert spec.load_eval_dataset()["target"] == list(range(1, 10))
    assert spec.success_threshold == 1.0


def test_coding_env_rewards_the_last_program_and_contains_hostile_code(scripted_loop):
    hostile = "import os\nwhile True:\n    os.fork()"
    loop = scripted_loop([])
    _, rollout, (source, reward) = rollout_with(
        loop, "coding", {"task_id": "fib"},
        lambda env: [call("run_code", code=hostile), call("run_code", code=env.task["solution"] + "print(fib(10))"), "Done."],
    )
    assert source.__name__ == "CodingEnv" and reward == 1.0
    assert rollout.tool_call_count == 2 and rollout.tool_failure_count == 1
    tool_messages = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert "SandboxError" in tool_messages[0] and tool_messages[1] == "55\n"
