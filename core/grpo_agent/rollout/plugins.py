"""Resolve the config's advantage estimator and prompt filters to plain callables, once.

Design decision: the loop never talks to the plugin host while running; it asks the registry
once at construction (in the worker process).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from grpo_agent.error_text import error_text
from grpo_agent.plugins import load_registry
from grpo_agent.rollout.prompts import PromptFilter
from grpo_agent.types import RolloutGroup

AdvantageEstimator = Callable[[RolloutGroup], np.ndarray]
_FIELDS = {"advantage estimator": "advantage_estimator", "prompt filter": "prompt_filters"}


class PluginCallError(ValueError):
    """The run's advantage estimator or a prompt filter raised, or returned advantages that
    cannot train; the run stops naming it (a bare `KeyError: 'x'` from the worker would not)."""


def call_plugin(kind: str, name: str, func: Callable, *args):
    """`func(*args)`; an exception becomes one line naming the plugin (`kind` 'advantage
    estimator' or 'prompt filter', `name` as the config selects it) and the fix, chained."""
    try:
        return func(*args)
    except Exception as error:
        raise PluginCallError(
            f"The {kind} {name!r} raised {error_text(error)}. Fix it (the traceback "
            f"in error.log shows where), or select another with the config field "
            f"{_FIELDS[kind]}.") from error


def accept_prompt(name: str, accept: PromptFilter, row_index: int, row: dict, epoch: int) -> bool:
    """One prompt filter's verdict, which must be a bool: a filter that forgot its `return`
    (None) rejected every prompt, and the run stopped blaming `filter_prompt`, not the filter."""
    verdict = call_plugin("prompt filter", name, accept, row_index, row, epoch)
    if not isinstance(verdict, (bool, np.bool_)):
        raise PluginCallError(
            f"The prompt filter {name!r} returned {verdict!r} for row {row_index}; return True to "
            f"keep the prompt or False to skip it.")
    return bool(verdict)


def check_advantages(advantages, rewards: np.ndarray, where: str) -> np.ndarray:
    """`advantages` as floats, one per rollout, finite wherever the rollout was scored: a NaN
    or inf advantage makes the loss NaN, and the NaN weights reach the server at the next push.
    `where` names what computed them. Unscored rollouts (NaN reward) never train, so any value
    is allowed there."""
    try:
        values = np.asarray(advantages, dtype=float)
    except (TypeError, ValueError) as error:
        raise PluginCallError(
            f"compute_advantages returned {type(advantages).__name__} {advantages!r:.80}, which is "
            f"not numbers; return one float per rollout ({where}).") from error
    if values.shape != rewards.shape:
        raise PluginCallError(
            f"compute_advantages returned shape {values.shape} for a group of {len(rewards)} "
            f"rollouts; return one advantage per rollout ({where}).")
    bad = np.flatnonzero(~np.isfinite(values) & ~np.isnan(rewards))
    if len(bad):
        i = int(bad[0])
        raise PluginCallError(
            f"compute_advantages returned {values[i]} for scored rollout {i} (reward "
            f"{rewards[i]:g}), which would make the loss and weights NaN: return a finite "
            f"advantage, 0 to not train it ({where}).")
    return values


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
