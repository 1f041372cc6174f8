"""Spec lines 735-761 (the self-sampling `IncrementEnv`, verbatim) and 819-820 (`format_reward`,
whose body the spec leaves as `...`: here, 1.0 when the rollout ends on a plain answer, i.e.
its last message is the assistant's and calls no tool)."""
import random


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


def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text
    return [float(c[-1]["role"] == "assistant" and not c[-1].get("tool_calls")) for c in completions]
