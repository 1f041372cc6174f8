"""The built-in rewards, advantage estimator and prompt filter, registered as a plugin.

Design decision: core registers its defaults through the same hooks third-party plugins use
(llm's default plugins), which keeps the hook API honest. Heavy imports stay inside the
functions: the CLI loads plugins at start-up to collect their commands.
"""
from __future__ import annotations

from typing import Any

from grpo_agent.plugins.decorators import advantage_estimator, prompt_filter, reward
from grpo_agent.plugins.hookspecs import hookimpl
from grpo_agent.rewards import accuracy_reward, format_reward


@advantage_estimator("group_norm")
def group_norm(group: Any) -> Any:
    """(r - mean) / std within the group over non-NaN rewards; NaN rewards and std=0 give 0."""
    import numpy as np  # lazily: plugins load at CLI start-up, which must stay fast

    rewards = np.asarray(group.rewards, dtype=float)
    advantages = np.zeros(len(rewards))
    scored = ~np.isnan(rewards)
    if scored.sum() < 2:
        return advantages
    values = rewards[scored]
    std = values.std()
    if std > 0:
        advantages[scored] = (values - values.mean()) / std
    return advantages


@prompt_filter("all")
def accept_all(row_index: int, row: dict, epoch: int) -> bool:
    """Keep every prompt (the spec's default `filter_prompt`)."""
    return True


@hookimpl
def register_rewards(register):
    register(reward("accuracy")(accuracy_reward))
    register(reward("format")(format_reward))


@hookimpl
def register_advantage_estimators(register):
    register(group_norm)


@hookimpl
def register_prompt_filters(register):
    register(accept_all)
