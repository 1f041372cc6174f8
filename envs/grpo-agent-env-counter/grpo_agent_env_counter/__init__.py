"""The spec's IncrementEnv as a plugin: reach a self-sampled target with an `increment` tool.

Design decision: the env owns its training data (no dataset): `reset` samples a target and
returns the prompt, so `max_steps` sets the run length, and `get_reward` scores the counter's
final state. Its eval split names each target once (`target` rows), so an evaluation sees every
target the task has, and a greedy one is deterministic: held-out success is the share of targets
the policy reaches (the `make demo` measure).
"""
from __future__ import annotations

import random

from grpo_agent import environment, hookimpl

MAX_TARGET = 9


def eval_rows():
    """Every target once: the env's declared eval split."""
    from datasets import Dataset

    return Dataset.from_dict({"target": list(range(1, MAX_TARGET + 1))})


def solve(env: CounterEnv, row: dict) -> None:
    """Gold solution for `grpo-agent env check`: one increment by the whole target."""
    env.increment(env.target)


@environment(
    "counter",
    version=1,
    tool_examples={"increment": {"step": 1}},
    gold=solve,
    eval_dataset=eval_rows,
    success_threshold=1.0,
    description="Reach a self-sampled target (1-9) by calling increment(step).",
)
class CounterEnv:
    """Increment a counter until it equals the target."""

    def reset(self, target: int | None = None, **row) -> str:
        self.counter = 0
        self.target = random.randint(1, MAX_TARGET) if target is None else int(target)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


@hookimpl
def register_environments(register):
    register(CounterEnv)
