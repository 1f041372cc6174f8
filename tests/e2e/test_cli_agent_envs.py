"""`grpo-agent train --env NAME --agent ...` on env packages whose rows hold no full prompt.

An agent program gets only the dataset row. reasoning-gym's rows hold just the system message
(its reset() writes the question), so the CLI writes each row's prompt as the tool loop builds
it; envs whose tools and get_reward() make the reward (coding, textarena, counter) are refused
before any server starts, naming the env, the missing column and what to run instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
CLI = [sys.executable, "-m", "grpo_agent.cli.main"]


@pytest.mark.parametrize("env, column_note", [
    ("coding", "no 'prompt' column"),
    ("textarena", "no 'prompt' column"),
    ("counter", "no dataset"),
])
def test_an_env_whose_tools_score_it_is_refused_before_a_server_starts(env, column_note, tmp_path, capsys):
    """In this process (the refusal needs no server; a subprocess would cost a CLI start-up,
    ~30-90 s on a loaded CI box): the exit code and the message the user reads on stderr."""
    from grpo_agent.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", env, "--agent-cmd", "true", "--output-dir", str(out)])
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert f"The env '{env}-v1'" in message and column_note in message, message
    assert "get_reward()" in message and f"Train '{env}-v1' without --agent" in message, message
    assert "Traceback" not in message and "the run failed" not in message, message
    assert not (out / "config.json").exists()  # refused before the server and the trainer


@pytest.mark.vllm
@pytest.mark.slow
def test_an_agent_on_reasoning_gym_gets_the_question_in_its_rows_prompt(private_server, tmp_path):
    pytest.importorskip("reasoning_gym")
    out = tmp_path / "run"
    prompts_log = tmp_path / "prompts.jsonl"
    env = {**os.environ, "PROBE_PROMPTS_LOG": str(prompts_log),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    args = ["train", "--env", "reasoning-gym", "--env-arg", "task=basic_arithmetic",
            "--env-arg", "size=8", "--agent", "prompt_probe_agent:probe", "--output-dir", str(out),
            "--vllm-url", private_server.base_url, "--set", "max_steps=1",
            "--set", "num_generations=2", "--set", "max_completion_length=8",
            "--set", "gradient_checkpointing=false", "--set", "save_strategy=no",
            "--set", "learning_rate=0.0", "--set", "token_budget=256"]
    log = tmp_path / "cli.log"
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=900, check=False)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, log.read_text()[-4000:]
    # What each agent call was given, from the agent itself: the logged reward says the same,
    # but a 1-step run's last rollout metrics can miss the step they belong to.
    prompts = [json.loads(line) for line in prompts_log.read_text().splitlines()]
    assert len(prompts) >= 2, log.read_text()[-4000:]  # one group of num_generations=2
    for prompt in prompts:
        questions = [m["content"] for m in prompt if m["role"] == "user"]
        assert questions and any(ch.isdigit() for ch in questions[0]), prompt  # the arithmetic task
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sum(r.get("harness/errors_count", 0) for r in rows) == 0, log.read_text()[-4000:]


def test_an_agent_only_env_keeps_its_rows_for_its_own_agent():
    """verifiers' env is `agent_only`: its reset() refuses to run, its rows go to its agent as
    they are (no reset-built prompt, no refusal)."""
    from datasets import Dataset
    from grpo_agent.train.run import agent_task

    class AgentOnlyEnv:
        agent_only = "its-agent"

        def reset(self, **row):
            raise RuntimeError("played by its agent only")

    rows = Dataset.from_dict({"prompt": ["Reverse 'abc'."], "vf_idx": [0]})
    task = {"id": "agent-only-v1", "dataset": rows, "environment_factory": AgentOnlyEnv,
            "eval_dataset": lambda: None}
    assert agent_task(task) is task


def test_an_agent_only_env_without_its_agent_is_refused_before_a_server_starts(tmp_path, capsys):
    """`grpo-agent train --env verifiers --env-arg id=...` without `--agent verifiers` used to start
    the server and the trainer, then stop after 10 groups whose reset() refused (20 s against a
    running server, plus a managed server's start). Refused before the taskset loads, so no
    verifiers venv or taskset is needed here."""
    from grpo_agent import environment
    from grpo_agent.train.run import AgentEnvError, refuse_agent_only_env

    @environment("agent-only", options=[])
    class AgentOnlyEnv:
        agent_only = "its-agent"

        def __init__(self, id: str = ""):
            pass

        def reset(self, **row):
            raise RuntimeError("played by its agent only")

    import functools

    for factory in (AgentOnlyEnv, functools.partial(AgentOnlyEnv, id="tasks")):
        with pytest.raises(AgentEnvError, match="add --agent its-agent"):
            refuse_agent_only_env("agent-only-v1", factory)
    refuse_agent_only_env("words-v1", None)
    refuse_agent_only_env("routed", {"a": AgentOnlyEnv})

    from grpo_agent.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "verifiers", "--env-arg", "id=no_such_taskset",
              "--output-dir", str(out)])
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert "The env 'verifiers-v1' is played by its own agent program" in message, message
    assert "--agent verifiers" in message and "Traceback" not in message, message
    assert not (out / "config.json").exists()  # refused before the server and the trainer


def test_the_python_trainer_refuses_an_agent_only_env_before_loading_the_model():
    """`AsyncGRPOTrainer(environment_factory=<verifiers' env>)` ran until 10 groups' reset()
    refused; it is refused at construction, naming HarnessAsyncGRPOTrainer and the agent."""
    import functools

    from grpo_agent import AsyncGRPOTrainer
    from grpo_agent.plugins import load_registry

    class AgentOnlyEnv:
        agent_only = "its-agent"

        def reset(self, **row):
            raise RuntimeError("played by its agent only")

    for factory in (AgentOnlyEnv, functools.partial(AgentOnlyEnv), {"a": AgentOnlyEnv}):
        with pytest.raises(ValueError, match=r"HarnessAsyncGRPOTrainer\(agent='its-agent'"):
            AsyncGRPOTrainer(model="/no/such/model", environment_factory=factory)
    for factory in ("verifiers", load_registry().environment_spec("verifiers")):
        with pytest.raises(ValueError, match="--agent verifiers"):
            AsyncGRPOTrainer(model="/no/such/model", environment_factory=factory)
