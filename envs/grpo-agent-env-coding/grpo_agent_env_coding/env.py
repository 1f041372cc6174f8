"""The coding environment: small function-writing tasks scored by their unit tests.

Design decision: the environment owns its data (tasks shipped in `tasks.json`, each with a
reference solution so `grpo-agent env check` can prove the tests pass), exposes one tool,
`run_code`, and scores the last program the model ran: the program and the task's assertions
execute together in `grpo_agent.sandbox` (no network, time/memory/process limits, a
throwaway folder, user `nobody`), and the reward is the fraction of assertions that pass.
A program that crashes, loops or breaks a limit in `run_code` is a failed tool call the
model sees; in `get_reward` it simply scores 0.
"""
from __future__ import annotations

import json
import random
from functools import lru_cache
from importlib import resources

from grpo_agent.sandbox import SandboxLimits, run_python, run_python_or_raise

TOOL_LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=5, memory_mb=512)
_HARNESS = """
import json
passed = 0
for check in json.loads({tests!r}):
    try:
        passed += bool(eval(check))
    except Exception:
        pass
print("__RESULT__", passed)
"""


@lru_cache(maxsize=1)
def load_tasks() -> tuple[dict, ...]:
    """The shipped tasks: `task_id`, `prompt`, `tests` (Python expressions), `solution`."""
    text = resources.files("grpo_agent_env_coding").joinpath("tasks.json").read_text("utf-8")
    return tuple(json.loads(text))


def score_program(code: str, tests: list[str], limits: SandboxLimits = TOOL_LIMITS) -> float:
    """Fraction of `tests` that hold after running `code`, all inside one sandboxed run."""
    result = run_python(code + "\n" + _HARNESS.format(tests=json.dumps(tests)), limits=limits)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("__RESULT__ "):
            return int(line.split()[1]) / len(tests)
    return 0.0


class CodingEnv:
    """One coding task per rollout; `run_code` is the model's only tool."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)
        self._by_id = {task["task_id"]: task for task in load_tasks()}

    def reset(self, task_id: str | None = None, **row) -> str:
        if task_id is not None and task_id not in self._by_id:
            raise KeyError(f"Unknown coding task {task_id!r}; known: {sorted(self._by_id)}.")
        self.task = self._by_id[task_id] if task_id else self._rng.choice(list(self._by_id.values()))
        self.last_code: str | None = None
        return (
            f"{self.task['prompt']} Test it with the run_code tool; the last code you run is "
            "graded by hidden unit tests."
        )

    def get_reward(self) -> float:
        if self.last_code is None:
            return 0.0
        return score_program(self.last_code, self.task["tests"])

    def run_code(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: The complete Python source to execute.

        Returns:
            The program's standard output (truncated when long).
        """
        self.last_code = code
        return run_python_or_raise(code, limits=TOOL_LIMITS)
