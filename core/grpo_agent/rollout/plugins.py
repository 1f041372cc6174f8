"""Resolve the config's advantage estimator and prompt filters to plain callables, once.

Design decision: the loop never talks to the plugin host while running; it asks the registry
once at construction (in the worker process). The built-in group normalisation is also
available without the registry, so the loop works in a bare install.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from grpo_agent.rollout.prompts import PromptFilter
from grpo_agent.rollout.scoring import group_norm_advantages
from grpo_agent.types import RolloutGroup

AdvantageEstimator = Callable[[RolloutGroup], np.ndarray]


def group_norm(group: RolloutGroup) -> np.ndarray:
    """The spec's default: rewards normalised within the group, NaN rewards get 0."""
    return group_norm_advantages(np.asarray(group.rewards, dtype=float))


def _registry():
    try:
        from grpo_agent.plugins import load_registry
    except ImportError:
        return None
    return load_registry()


def resolve_advantage_estimator(name: str, plugin_args: dict | None = None) -> AdvantageEstimator:
    """The estimator with its options from `plugin_args` bound (see grpo_agent.plugins.options)."""
    registry = _registry()
    if registry is not None:
        return registry.bind_plugin("advantage_estimator", name, plugin_args)
    if name == "group_norm":
        return group_norm
    raise ValueError(
        f"advantage_estimator={name!r} is not available: only the built-in 'group_norm' exists "
        "without the plugin host. Install the plugin that provides it or use 'group_norm'.")


def resolve_prompt_filters(names: list[str], plugin_args: dict | None = None) -> list[PromptFilter]:
    if not names:
        return []
    registry = _registry()
    if registry is None:
        raise ValueError(
            f"prompt_filters={names!r} need the plugin host (grpo_agent.plugins), which is not "
            "installed; remove them or install the plugins that provide them.")
    return [registry.bind_plugin("prompt_filter", name, plugin_args) for name in names]


def check_plugin_args(config) -> None:
    """Fail before any rollout when `config.plugin_args` names an unused plugin or option."""
    if not getattr(config, "plugin_args", None):
        return
    registry = _registry()
    if registry is None:
        raise ValueError("plugin_args need the plugin host (grpo_agent.plugins), which is not installed.")
    registry.check_plugin_args(config.plugin_args, {
        "advantage_estimator": [config.advantage_estimator],
        "prompt_filter": list(config.prompt_filters),
    })
