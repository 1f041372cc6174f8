"""The built-in rewards, advantage estimator and prompt filter, registered as a plugin.

Design decision: core registers its defaults through the same hooks third-party plugins use
(llm's default plugins), which keeps the hook API honest. Heavy imports stay inside the
functions: the CLI loads plugins at start-up to collect their commands.
"""
from __future__ import annotations

from grpo_agent import advantages
from grpo_agent.plugins.decorators import advantage_estimator, prompt_filter, reward
from grpo_agent.plugins.hookspecs import hookimpl
from grpo_agent.rewards import accuracy_reward, format_reward

group_norm = advantage_estimator("group_norm")(advantages.group_norm)


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
