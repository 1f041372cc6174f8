"""The spec's agent-training examples as written (only the import line changed).

Module-level so the spawned rollout worker can import them by name; `tests/agent/conftest.py`
puts this folder on `sys.path` (children inherit it).
"""
import random

from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: F401  (the spec's import line)


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
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


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        ...


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        ...


def reward_func(completions, **kwargs):
    """The multi-environment example's trainer-owned reward (the spec leaves it open): the
    length of the final message, capped, so groups of sampled rollouts rarely tie."""
    return [min(len(completion[-1]["content"] or ""), 64) / 64 for completion in completions]
