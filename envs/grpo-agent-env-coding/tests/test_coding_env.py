"""The coding environment: shipped tasks, sandboxed run_code, reward from the unit tests."""
from __future__ import annotations

import pytest
from grpo_agent.sandbox import SandboxError
from grpo_agent_env_coding import CodingEnv, load_tasks
from grpo_agent_env_coding.env import score_program


def test_every_reference_solution_passes_its_tests_and_empty_code_fails_them():
    for task in load_tasks():
        assert score_program(task["solution"], task["tests"]) == 1.0, task["task_id"]
    assert score_program("", load_tasks()[0]["tests"]) == 0.0


def test_reward_is_the_fraction_of_tests_the_last_run_program_passes():
    env = CodingEnv(seed=0)
    prompt = env.reset(task_id="fib")
    assert "fib(n)" in prompt and "run_code" in prompt
    assert env.get_reward() == 0.0  # nothing run yet
    assert env.run_code("def fib(n):\n    return n\nprint(fib(1))") == "1\n"
    assert env.get_reward() == 0.5  # fib(0), fib(1) pass; fib(10), fib(20) fail
    env.run_code(next(t for t in load_tasks() if t["task_id"] == "fib")["solution"])
    assert env.get_reward() == 1.0


def test_crashing_code_is_a_tool_error_and_scores_zero():
    env = CodingEnv(seed=0)
    env.reset(task_id="add")
    with pytest.raises(SandboxError, match="NameError"):
        env.run_code("print(undefined_name)")
    assert env.get_reward() == 0.0


def test_reset_samples_a_task_and_rejects_unknown_ids():
    env = CodingEnv(seed=1)
    prompts = {env.reset() for _ in range(20)}
    assert len(prompts) > 1
    with pytest.raises(KeyError, match="Unknown coding task 'nope'"):
        env.reset(task_id="nope")
