"""`check_environment` reports each failing step instead of stopping at the first."""
from __future__ import annotations

from grpo_agent import environment, hookimpl
from grpo_agent.plugins import build_registry
from grpo_agent.plugins.check import check_environment


def wrong_gold(env, row):
    env.push(1)


@environment("stuck", tool_examples={"push": {"amount": 2}, "pull": {}}, gold=wrong_gold)
class StuckEnv:
    """An env whose gold answer does not solve it and whose pull tool crashes."""

    def reset(self, **row):
        self.total = 0
        return "Reach 5."

    def get_reward(self) -> float:
        return float(self.total == 5)

    def push(self, amount: int) -> int:
        """Push.

        Args:
            amount: How much to push.
        """
        self.total += amount
        return self.total

    def pull(self) -> int:
        """Pull (broken)."""
        raise RuntimeError("the rope snapped")


class StuckPlugin:
    __name__ = "stuck"

    @hookimpl
    def register_environments(self, register):
        register(StuckEnv)


def test_failing_steps_are_reported_with_their_errors():
    registry = build_registry(StuckPlugin())
    steps = {step.name: step for step in check_environment(registry.environment_spec("stuck"), registry, 1)}
    assert steps["reset row 0"].ok and steps["reset row 0"].detail == "'Reach 5.'"
    assert steps["tool push({'amount': 2}) row 0"].detail == "returned 2"
    assert not steps["tool pull({}) row 0"].ok
    assert steps["tool pull({}) row 0"].detail == "RuntimeError: the rope snapped"
    gold = steps["gold answer row 0"]
    assert not gold.ok and gold.detail == "ValueError: the gold answer scored 0.0; expected a positive reward."


def test_a_reset_without_prompt_and_no_prompt_column_fails():
    class Silent:
        def reset(self, **row):
            return None

    registry = build_registry()
    from grpo_agent.plugins.registry import environment_spec_from_class

    steps = check_environment(environment_spec_from_class(Silent, "silent", "test"), registry, 1)
    (reset,) = [step for step in steps if step.name == "reset row 0"]
    assert not reset.ok and "returned None and the row has no 'prompt' column" in reset.detail
