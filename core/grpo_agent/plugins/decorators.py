"""Decorators that *mark* plugin objects with a name; they never register or wrap anything.

Design decision: a decorated object is returned unchanged with a `Marker` stored on
`__grpo_agent__`, so it still pickles, still works with plain TRL-style code, and only enters a
registry when a plugin's hook hands it to `register` (nothing happens at import time). Every
decorator works bare (`@tool`) and called (`@reward("accuracy")`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

MARKER_ATTRIBUTE = "__grpo_agent__"

T = TypeVar("T")


@dataclass(frozen=True)
class Marker:
    """What a decorator recorded: the kind of object, its name and kind-specific options."""

    kind: str
    name: str | None
    options: Mapping[str, Any] = field(default_factory=dict)


def get_marker(obj: Any) -> Marker | None:
    """The marker set by one of the decorators, or None for an unmarked object."""
    marker = getattr(obj, MARKER_ATTRIBUTE, None)
    return marker if isinstance(marker, Marker) else None


def _mark(kind: str, obj: T, name: str | None, options: Mapping[str, Any] | None = None) -> T:
    setattr(obj, MARKER_ATTRIBUTE, Marker(kind, name, dict(options or {})))
    return obj


def _named_decorator(kind: str, name_or_obj: Any, options: Mapping[str, Any] | None = None):
    """Support both `@deco` (the object is passed directly) and `@deco("name")`."""
    if callable(name_or_obj) and not isinstance(name_or_obj, str):
        return _mark(kind, name_or_obj, None, options)
    if name_or_obj is not None and not isinstance(name_or_obj, str):
        raise TypeError(f"@{kind}(...) takes a name string, got {name_or_obj!r}.")

    def decorate(obj: T) -> T:
        return _mark(kind, obj, name_or_obj, options)

    return decorate


def environment(
    name: str | type | None = None,
    *,
    version: int | None = None,
    dataset: Callable[[], Any] | None = None,
    rewards: Sequence[str | Callable] = (),
    tool_examples: Mapping[str, Mapping[str, Any]] | None = None,
    gold: Callable[[Any, dict], str | None] | None = None,
    description: str | None = None,
    options: Sequence[Any] = (),
    eval_dataset: Callable[..., Any] | None = None,
    success_threshold: float | None = None,
):
    """Mark an environment class (`reset(**row)`, optional `get_reward()`, public tool methods).

    Args:
        name: Registered name; `version=1` registers `name-v1` and makes `name` its alias.
        dataset: Zero-argument function returning the env's `datasets.Dataset` (None: the env
            samples its own tasks in `reset` and `max_steps` sets the run length).
        rewards: Reward names or functions the env is scored by, besides `get_reward`.
        tool_examples: Example arguments per tool, used by `grpo-agent env check`.
        gold: `gold(env, row)` solves a reset env: it returns a gold completion text (scored by
            `rewards`) or None after driving the env to its solved state (scored by `get_reward`).
        description: One line for `grpo-agent env list` (default: the docstring's first line).
        options: `grpo_agent.Option`s; their values reach the class, `dataset` and
            `eval_dataset` as keyword arguments (`--env-arg key=value` on the command line).
        eval_dataset: Like `dataset`, for the env's evaluation split.
        success_threshold: The reward at which a rollout counts as solved (`eval/pass@*`;
            default 1.0).
    """
    marks = {
        "version": version,
        "dataset": dataset,
        "rewards": tuple(rewards),
        "tool_examples": dict(tool_examples or {}),
        "gold": gold,
        "description": description,
        "options": tuple(options),
        "eval_dataset": eval_dataset,
        "success_threshold": success_threshold,
    }
    return _named_decorator("environment", name, marks)


def tool(name_or_fn: Any = None):
    """Mark a tool function (type hints + Google-style docstring give its JSON schema)."""
    return _named_decorator("tool", name_or_fn)


# The plugin kinds below take `options=[Option(...)]`: values from the config's `plugin_args`
# reach the function as keyword arguments (see grpo_agent.plugins.options).


def reward(name_or_fn: Any = None, *, options: Sequence[Any] = ()):
    """Mark a reward function `(prompts, completions, completion_ids, **columns) -> list`."""
    return _named_decorator("reward", name_or_fn, {"options": tuple(options)})


def advantage_estimator(name_or_fn: Any = None, *, options: Sequence[Any] = ()):
    """Mark an advantage estimator `(group: RolloutGroup) -> np.ndarray`."""
    return _named_decorator("advantage_estimator", name_or_fn, {"options": tuple(options)})


def agent(name_or_fn: Any = None):
    """Mark an agent program `async def run(client: openai.AsyncOpenAI, row) -> float | None`."""
    return _named_decorator("agent", name_or_fn)


def prompt_filter(name_or_fn: Any = None, *, options: Sequence[Any] = ()):
    """Mark a prompt filter `(row_index, row, epoch) -> bool`."""
    return _named_decorator("prompt_filter", name_or_fn, {"options": tuple(options)})
