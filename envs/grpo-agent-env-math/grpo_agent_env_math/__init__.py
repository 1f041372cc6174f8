"""Arithmetic word problems shipped with the package, scored by the built-in `accuracy` reward.

Design decision: the dataset owns the task (conversational `prompt` + `solution` columns) and
the env is a thin class whose `reset` reads nothing back into the prompt, so a rollout is a
single answer scored by math-verify, the spec's reference-based reward. The 48 problems are
generated once with a fixed seed and stored in `problems.jsonl`.
"""
from __future__ import annotations

import json
from importlib.resources import files

from grpo_agent import environment, hookimpl

INSTRUCTION = "Solve the problem. Put the final number in \\boxed{}."


def load_problems():
    """The shipped problems as a `datasets.Dataset` with `prompt` and `solution` columns."""
    from datasets import Dataset

    text = files(__package__).joinpath("problems.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}] for row in rows
            ],
            "solution": [row["solution"] for row in rows],
        }
    )


def gold_answer(env: MathEnv, row: dict) -> str:
    """Gold completion for `grpo-agent env check`: the solution, boxed."""
    return f"The answer is \\boxed{{{row['solution']}}}."


@environment(
    "math",
    version=1,
    dataset=load_problems,
    rewards=["accuracy"],
    gold=gold_answer,
    description="Arithmetic word problems; answer in \\boxed{}, scored by accuracy.",
)
class MathEnv:
    """A word problem from the row; no tools, scored by the accuracy reward."""

    def reset(self, **row) -> None:
        self.solution = row.get("solution")


@hookimpl
def register_environments(register):
    register(MathEnv)
