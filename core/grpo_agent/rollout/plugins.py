"""Resolve the config's advantage estimator and prompt filters to plain callables, once.

Design decision: the loop never talks to the plugin host while running; it asks the registry
once at construction (in the worker process).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from grpo_agent.plugins import load_registry
from grpo_agent.rollout.prompts import PromptFilter
from grpo_agent.types import RolloutGroup

AdvantageEstimator = Callable[[RolloutGroup], np.ndarray]


def resolve_advantage_estimator(name: str, plugin_args: dict | None = None) -> AdvantageEstimator:
    """The estimator with its options from `plugin_args` bound (see grpo_agent.plugins.options)."""
    return load_registry().bind_plugin("advantage_estimator", name, plugin_args)


def resolve_prompt_filters(names: list[str], plugin_args: dict | None = None) -> list[PromptFilter]:
    if not names:
        return []
    registry = load_registry()
    return [registry.bind_plugin("prompt_filter", name, plugin_args) for name in names]


def check_plugin_args(config, reward_funcs=()) -> None:
    """Fail before any rollout when the config selects an unknown advantage estimator or prompt
    filter, or `config.plugin_args` names an unused plugin or option (`reward_funcs`: the run's
    reward functions, registered ones counting as in use)."""
    registry = load_registry()
    registry.resolve_advantage_estimator(config.advantage_estimator)
    for name in config.prompt_filters:
        registry.resolve_prompt_filter(name)
    if not getattr(config, "plugin_args", None):
        return
    registry.check_plugin_args(config.plugin_args, {
        "advantage_estimator": [config.advantage_estimator],
        "prompt_filter": list(config.prompt_filters),
        "reward": registry.names_of("reward", list(reward_funcs)),
    })
