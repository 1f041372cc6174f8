"""The `digits` demo environment: a task a ~1M-parameter random model can visibly learn on a CPU.

Design decision: `make demo` must show learning in minutes on two cores, so the reward has to be
dense and reachable by a random policy: the share of digit characters in the answer. A random
tiny model emits some digit tokens (its tokenizer was trained on arithmetic text), every group
has reward variance, and a few dozen GRPO steps at a high learning rate push the policy towards
digit tokens, which the reward curve shows. It is registered like any env plugin (through the
built-in plugin modules), so `grpo-agent train --env digits` takes the same path as any env.
"""
from __future__ import annotations

from typing import Any

from grpo_agent.plugins.decorators import environment, reward
from grpo_agent.plugins.hookspecs import hookimpl
from grpo_agent.rewards import completion_text

QUESTIONS = (
    "What is {a} plus {b}?",
    "Compute {a} times {b}.",
    "How much is {a} minus {b}?",
    "Write the number after {a}.",
)
NUM_PROMPTS = 256


def load_prompts():
    """Short arithmetic questions (conversational `prompt`, and their `solution`)."""
    from datasets import Dataset

    prompts, solutions = [], []
    for i in range(NUM_PROMPTS):
        a, b = 3 + (i * 7) % 90, 2 + (i * 13) % 40
        template = QUESTIONS[i % len(QUESTIONS)]
        answer = [a + b, a * b, a - b, a + 1][i % len(QUESTIONS)]
        prompts.append([{"role": "user", "content": template.format(a=a, b=b)}])
        solutions.append(str(answer))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


def digit_fraction(completions: list, **kwargs: Any) -> list[float]:
    """Share of non-space characters of the answer that are digits (0 for an empty answer)."""
    scores = []
    for completion in completions:
        chars = [c for c in completion_text(completion) if not c.isspace()]
        scores.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return scores


@environment(
    "digits",
    version=1,
    dataset=load_prompts,
    rewards=["digit_fraction"],
    description="Answer arithmetic questions with digits; dense reward for the CPU demo.",
)
class DigitsEnv:
    """No tools and no state: the dataset and the reward define the task."""

    def reset(self, **row) -> None:
        return None


@hookimpl
def register_environments(register):
    register(DigitsEnv)


@hookimpl
def register_rewards(register):
    register(reward("digit_fraction")(digit_fraction))
