"""Spec lines 696-722: the sync and async tools of the `tools=[multiply, async_add]` example
(verbatim), plus the test's reward: 1.0 when a tool returned the value the prompt asks for."""
import re


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b

async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def tool_result_reward(prompts, completions, **kwargs):
    rewards = []
    for prompt, completion in zip(prompts, completions):
        op, a, b = re.match(r"(Multiply|Add) (\d+) (?:by|and) (\d+)", prompt[-1]["content"]).groups()
        value = int(a) * int(b) if op == "Multiply" else int(a) + int(b)
        results = [m["content"] for m in completion if m["role"] == "tool"]
        rewards.append(float(str(value) in results))
    return rewards
