"""Scoring one group: run the reward functions together, sum the sources, normalise.

Design decision: a reward function's *result* is checked strictly (wrong length or type is a
programming error and stops the run at once, naming the function), but an *exception* from
it is treated as a flaky dependency: it costs only its group, and the run stops only when the
same function fails on `REWARD_FAILURE_WINDOW` groups in a row. Sources are the reward
functions, the environment's `get_reward` and `Rollout.reward`; `None` drops out of one
source's sum, and a rollout with no source at all gets NaN (advantage 0, outside mean/std).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_agent.types import RolloutGroup

logger = logging.getLogger(__name__)

REWARD_FAILURE_WINDOW = 10


class RewardFunctionError(RuntimeError):
    """A reward function or an environment's `get_reward` broke its contract (or a reward
    function kept raising); the run stops."""


@dataclass
class RewardFailure:
    """A reward function raised on one group: the group is dropped."""

    name: str
    traceback: str
    error: Exception | None = None  # the exception itself: the stopping error chains to it


@dataclass
class GroupScores:
    """Per-source rewards of one group (NaN = that source did not score that rollout)."""

    by_source: dict[str, np.ndarray] = field(default_factory=dict)

    def total(self, size: int) -> np.ndarray:
        """Sum over sources; NaN where no source scored the rollout."""
        if not self.by_source:
            return np.full(size, np.nan)
        stacked = np.stack(list(self.by_source.values()))
        scored = ~np.isnan(stacked)
        summed = np.where(scored, stacked, 0.0).sum(axis=0)
        return np.where(scored.any(axis=0), summed, np.nan)


def reward_name(func: Callable) -> str:
    """The name a reward function is logged under (`rewards/{name}/mean`)."""
    for candidate in (func, getattr(func, "func", None)):  # functools.partial wraps `func`
        name = getattr(candidate, "__name__", None)
        if name:
            return name
    return type(func).__name__


def reward_inputs(group: RolloutGroup) -> dict[str, Any]:
    """The keyword arguments every reward function receives for a group."""
    return {
        "prompts": group.prompts,
        "completions": group.completions,
        "completion_ids": group.completions_ids,
        **group.reward_kwargs,
    }


def _check_result(name: str, result: Any, size: int) -> np.ndarray:
    is_list = isinstance(result, (Sequence, np.ndarray)) and not isinstance(result, (str, bytes))
    if not is_list:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {type(result).__name__}; it must return a "
            f"list with one float (or None) per completion ({size} here)."
        )
    if len(result) != size:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(result)} rewards for {size} completions; "
            "return exactly one float (or None) per completion."
        )
    return np.asarray([checked_reward(value, f"Reward function {name!r}", f" for completion {index}")
                       for index, value in enumerate(result)], dtype=float)


def checked_reward(value: Any, who: str, where: str = "") -> float:
    """One reward (a reward function's, or an environment's `get_reward`) as a float, None as
    NaN (unscored); anything else stops the run naming `who`."""
    if value is None:
        return math.nan
    if isinstance(value, (numbers.Real, np.floating, np.integer)) and not isinstance(value, bool):
        if not math.isfinite(value):  # NaN would silently read as unscored, inf poisons the advantages
            raise RewardFunctionError(
                f"{who} returned {float(value)}{where}; rewards must be finite: return None to "
                "leave a completion unscored.")
        return float(value)
    raise RewardFunctionError(
        f"{who} returned a {type(value).__name__} ({value!r}) as a reward; each reward must be "
        "a float or None.")


async def _call_reward(func: Callable, inputs: dict[str, Any], executor: Executor) -> Any:
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):
        return await func(**inputs)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, lambda: func(**inputs))


async def run_reward_functions(
    reward_funcs: dict[str, Callable], group: RolloutGroup, executor: Executor
) -> tuple[GroupScores, RewardFailure | None]:
    """Run all reward functions concurrently; returns scores or the first failure."""
    size = len(group.completions)
    inputs = reward_inputs(group)
    names = list(reward_funcs)
    results = await asyncio.gather(
        *(_call_reward(reward_funcs[name], inputs, executor) for name in names),
        return_exceptions=True,
    )
    scores = GroupScores()
    failure = None
    for name, result in zip(names, results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            failure = failure or RewardFailure(
                name, "".join(traceback.format_exception(result)), result)
            continue
        scores.by_source[name] = _check_result(name, result, size)
    return scores, failure


def add_rollout_sources(scores: GroupScores, group: RolloutGroup) -> None:
    """Add the environment's `get_reward` and the custom loops' `Rollout.reward` sources."""
    size = len(group.completions)
    env_values: dict[str, np.ndarray] = {}
    for index, env_reward in enumerate(group.env_rewards):
        if env_reward is None:
            continue
        env_cls, value = env_reward
        column = env_values.setdefault(env_cls.__name__, np.full(size, np.nan))
        column[index] = value
    scores.by_source.update(env_values)
    if any(value is not None for value in group.rollout_rewards):
        scores.by_source["rollout"] = np.array(
            [math.nan if value is None else float(value) for value in group.rollout_rewards]
        )


def has_signal(rewards: np.ndarray) -> bool:
    """False for groups the spec drops: fewer than two scored rollouts, or all equal."""
    scored = rewards[~np.isnan(rewards)]
    return len(scored) >= 2 and bool(np.ptp(scored) > 0)


class RewardFailureTracker:
    """Stops the run when one reward function fails on every group of a window."""

    def __init__(self, window: int = REWARD_FAILURE_WINDOW):
        self.window = window
        self._streaks: dict[str, int] = {}
        self._logged: set[str] = set()

    def record(self, names: list[str], failure: RewardFailure | None) -> None:
        for name in names:
            if failure is None or failure.name != name:
                self._streaks[name] = 0
        if failure is None:
            return
        streak = self._streaks.get(failure.name, 0) + 1
        self._streaks[failure.name] = streak
        if failure.name not in self._logged:
            self._logged.add(failure.name)
            logger.error("Reward function %r raised; its group is dropped.\n%s",
                         failure.name, failure.traceback)
        if streak >= self.window:
            # One line, chained to the exception: the CLI shows a worker failure's last line,
            # which must name the reward function (not only its exception's own words).
            last = failure.traceback.rstrip().splitlines()[-1] if failure.traceback.strip() else "?"
            raise RewardFunctionError(
                f"Reward function {failure.name!r} raised on {streak} groups in a row, so the run "
                f"stops (the last: {last}). Fix it: its first traceback is logged above."
            ) from failure.error
