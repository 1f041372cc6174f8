"""Built-in reward functions (`from grpo_agent.rewards import accuracy_reward`).

Design decision: they follow TRL's signatures and behaviour so the spec's examples run
unchanged: conversational `completions`, dataset columns as keyword arguments, `None` for a
completion that cannot be scored (the trainer leaves it out of the group statistics). Both are
registered as plugins (`accuracy`, `format`) by `grpo_agent.plugins.builtins`.
"""
from __future__ import annotations

import re
from typing import Any

from grpo_agent.math_verifier import check_answer

THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text a reward scores: the last assistant message of a conversation, or the string."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role", "assistant") == "assistant":
            return message.get("content") or ""
    return ""


def accuracy_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the `solution` column, else 0.0.

    Gold and answer are parsed with math-verify; the answer must be in LaTeX (e.g. `\\boxed{}`).
    A gold solution that cannot be parsed gives None (unscorable), not a wrong-answer 0. The
    checks run in a helper process (`grpo_agent.math_verifier`), so this works from the rollout
    worker's scorer threads, where math-verify's signal-based timeouts cannot.
    """
    return [check_answer(completion_text(completion), str(gold))
            for completion, gold in zip(completions, solution, strict=True)]


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion opens with one `<think>...</think>` block, else 0.0."""
    return [1.0 if THINK_FORMAT.match(completion_text(c)) else 0.0 for c in completions]
