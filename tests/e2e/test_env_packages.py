"""Env packages from the registry train end to end: the CLI, env options, the real server.

No learning claim (the tiny random model writes no <answer> tags): the run must start the
rollout worker with the env's options bound, score every group with the package's own scorer
and finish, logging the env's reward.
"""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

REWARD = "rewards/reasoning_gym_reward/mean"  # the package's reward, logged under its name


def test_reasoning_gym_task_trains_through_the_cli(cli, private_server, tmp_path):
    pytest.importorskip("grpo_agent_env_reasoning_gym")
    out = tmp_path / "run"
    cli.run([
        "train", "--env", "reasoning-gym", "--env-arg", "task=basic_arithmetic", "--env-arg", "size=4",
        "--vllm-url", private_server.base_url, "--output-dir", str(out),
        "--set", "num_train_epochs=1", "--set", "num_generations=2", "--set", "max_completion_length=8",
        "--set", "gradient_checkpointing=false", "--set", "optim=adamw_torch", "--set", "save_strategy=no",
    ], tmp_path / "cli.log", timeout=420)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row[REWARD] for row in metrics if REWARD in row]
    assert rewards and all(0.0 <= reward <= 1.0 for reward in rewards), metrics
    assert (out / "final" / "config.json").is_file()
