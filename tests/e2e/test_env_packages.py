"""Env packages from the registry train end to end: the CLI, env options, the real server.

No learning claim (the tiny random model writes no <answer> tags and calls no tool): the run
must start the rollout worker with the env's options bound, score every group with the
package's own scorer and finish, logging the env's reward.
"""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

REWARD = "rewards/reasoning_gym_reward/mean"  # the package's reward, logged under its name

# One short epoch of the tiny model: each env's run only has to finish with scored groups.
SHORT_RUN = [
    "--set", "num_train_epochs=1", "--set", "num_generations=2", "--set", "max_completion_length=8",
    "--set", "gradient_checkpointing=false", "--set", "optim=adamw_torch", "--set", "save_strategy=no",
]


def test_reasoning_gym_task_trains_through_the_cli(cli, private_server, tmp_path):
    pytest.importorskip("grpo_agent_env_reasoning_gym")
    out = tmp_path / "run"
    cli.run([
        "train", "--env", "reasoning-gym", "--env-arg", "task=basic_arithmetic", "--env-arg", "size=4",
        "--vllm-url", private_server.base_url, "--output-dir", str(out),
        *SHORT_RUN,
    ], tmp_path / "cli.log", timeout=420)
    assert_trained(out, REWARD)


def test_coding_env_trains_through_the_design_cards_command(cli, private_server, tmp_path):
    """`grpo-agent train --env coding`, shortened: every group's programs are scored by the
    env's own get_reward (run in the sandbox), and the run's tool metrics are logged."""
    pytest.importorskip("grpo_agent_env_coding")
    out = tmp_path / "run"
    cli.run([
        "train", "--env", "coding",
        "--vllm-url", private_server.base_url, "--output-dir", str(out),
        *SHORT_RUN,
    ], tmp_path / "cli.log", timeout=420)
    metrics = assert_trained(out, "rewards/CodingEnv/mean")
    assert any("tools/call_frequency" in row for row in metrics), metrics  # run_code was offered


def test_textarena_game_trains_through_the_cli(cli, private_server, tmp_path):
    """A TextArena game as a multi-turn tool env: every group scored by TextArena's outcome."""
    pytest.importorskip("grpo_agent_env_textarena")
    pytest.importorskip("textarena")
    out = tmp_path / "run"
    cli.run([
        "train", "--env", "textarena", "--env-arg", "game=TowerOfHanoi-v0", "--env-arg", "size=4",
        "--vllm-url", private_server.base_url, "--output-dir", str(out),
        *SHORT_RUN,
    ], tmp_path / "cli.log", timeout=420)
    metrics = assert_trained(out, "rewards/TextArenaEnv/mean")
    assert any("tools/call_frequency" in row for row in metrics), metrics  # move was offered


def test_openenv_environment_trains_through_the_cli(cli, private_server, tmp_path):
    """An OpenEnv MCPEnvironment stepped in process: every group scored by the env's own
    observation rewards, the step tool offered to the model."""
    pytest.importorskip("grpo_agent_env_openenv")
    pytest.importorskip("openenv.core")
    out = tmp_path / "run"
    cli.run([
        "train", "--env", "openenv", "--env-arg", "size=4",
        "--vllm-url", private_server.base_url, "--output-dir", str(out),
        *SHORT_RUN,
    ], tmp_path / "cli.log", timeout=420)
    metrics = assert_trained(out, "rewards/OpenEnvEnv/mean")
    assert any("tools/call_frequency" in row for row in metrics), metrics  # step was offered


def test_openenv_server_by_url_trains_through_the_cli(cli, private_server, tmp_path):
    """The same env served by openenv-core's own server (uvicorn, a local port) and played by
    URL: one WebSocket session per episode, every group scored by the server's rewards."""
    pytest.importorskip("grpo_agent_env_openenv")
    pytest.importorskip("openenv.core")
    from grpo_agent_env_openenv.serve import serving

    out = tmp_path / "run"
    with serving() as env_server:
        cli.run([
            "train", "--env", "openenv", "--env-arg", f"url={env_server.url}", "--env-arg", "size=4",
            "--vllm-url", private_server.base_url, "--output-dir", str(out),
            *SHORT_RUN,
        ], tmp_path / "cli.log", timeout=420)
    metrics = assert_trained(out, "rewards/OpenEnvEnv/mean")
    assert any("tools/call_frequency" in row for row in metrics), metrics  # step was offered
    assert not any(row.get("rollout/env_error_group_count") for row in metrics), metrics


def assert_trained(out, reward: str) -> list[dict]:
    """The run logged `reward` within [0, 1] and saved its final model; its metric rows."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row[reward] for row in metrics if reward in row]
    assert rewards and all(0.0 <= value <= 1.0 for value in rewards), metrics
    assert (out / "final" / "config.json").is_file()
    return metrics
