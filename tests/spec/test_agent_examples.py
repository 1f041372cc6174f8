"""The spec's agent examples through `AsyncGRPOTrainer`, against a real server on the
tool-warmed tiny model (the random one never writes a tool call). Without thinking, as the
spec's environment examples run. The self-sampling `IncrementEnv` and the multi-environment
example alone are in tests/agent/test_agent_vllm.py.
"""
from __future__ import annotations

import pytest
from datasets import Dataset
from spec_harness import record_run, spec_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def agent_args(server, tmp_path, **changes):
    """Turns of at most 48 tokens (a tool call fits), two tool rounds, rows of 1024 tokens."""
    settings = {"chat_template_kwargs": {"enable_thinking": False}, "max_completion_length": 48,
                "max_tool_calling_iterations": 2, "token_budget": 1024}
    return spec_args(server, tmp_path, **{**settings, **changes})


def test_sync_and_async_tools_are_called(warm_server, tmp_path):
    """Spec lines 696-727: `tools=[multiply, async_add]`. Both tools run (the sync one in the
    worker's thread pool, the async one awaited) and their results reach the conversation."""
    from grpo_agent import AsyncGRPOTrainer
    from spec_examples.tools import async_add, multiply, tool_result_reward

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in (
        "Multiply 3 by 4.", "Add 2 and 5.", "Multiply 6 by 7.", "Add 8 and 1.")]})
    trainer = AsyncGRPOTrainer(
        model=str(warm_server.model_path),
        reward_funcs=tool_result_reward,
        train_dataset=dataset,
        tools=[multiply, async_add],
        args=agent_args(warm_server, tmp_path),
    )
    run = record_run(trainer)

    assert sum(run.values("tools/multiply/call_count")) > 0
    assert sum(run.values("tools/async_add/call_count")) > 0
    assert sum(run.values("rewards/tool_result_reward/mean")) > 0  # a right result came back
    assert max(run.values("rollout/turns_max")) >= 2  # the results fed a next turn
    assert run.trained and trainer.state.global_step == 1


def test_increment_env_reads_the_target_column(warm_server, tmp_path):
    """Spec lines 784-813: the dataset owns the task; each row's `target` reaches
    `reset(target=...)`, and `get_reward` scores the counter against it."""
    from grpo_agent import AsyncGRPOTrainer
    from spec_examples.increment_env_dataset import IncrementEnv, dataset

    trainer = AsyncGRPOTrainer(
        model=str(warm_server.model_path),
        train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
        environment_factory=IncrementEnv,
        args=agent_args(warm_server, tmp_path),
    )
    run = record_run(trainer)

    env_rewards = run.values("rewards/IncrementEnv/mean")
    assert env_rewards and len(env_rewards) == len(run.values("reward"))
    assert set(env_rewards) <= {0.0, 1.0} and sum(env_rewards) > 0  # some rollout hit its row's target
    assert sum(run.values("tools/increment/call_count")) > 0
    assert run.values("env/reset_s") and run.values("env/reward_s")
    assert run.trained and "rewards/IncrementEnv/mean" in run.logs[-1]


def test_format_reward_beside_the_environment_reward(warm_server, tmp_path):
    """Spec lines 819-827 with the self-sampling `IncrementEnv` of lines 735-769 (no dataset:
    the environment owns the data, so `max_steps` sets the length): every rollout's reward is
    the sum of the trainer-owned `format_reward` and the environment's `get_reward`."""
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: F401 (the spec's import line)
    from spec_examples.increment_env import IncrementEnv, format_reward

    trainer = AsyncGRPOTrainer(
        model=str(warm_server.model_path),
        args=agent_args(warm_server, tmp_path, max_steps=1),
        reward_funcs=format_reward,          # trainer-owned: scores the completion
        environment_factory=IncrementEnv,    # env-owned: scores its internal state via `get_reward`
    )
    run = record_run(trainer)

    formatted, env = run.values("rewards/format_reward/mean"), run.values("rewards/IncrementEnv/mean")
    assert formatted and len(formatted) == len(env)
    assert run.values("reward") == [f + e for f, e in zip(formatted, env)]  # weight 1 each
    assert set(env) <= {0.0, 1.0} and sum(run.values("tools/increment/call_count")) > 0
    assert run.trained
    logged = run.logs[-1]
    assert logged["reward"] == pytest.approx(logged["rewards/format_reward/mean"]
                                             + logged["rewards/IncrementEnv/mean"])
