"""Environments for agent rollouts: pooling, routing, reset and reward off the event loop.

Design decision: an environment instance is expensive to build and cheap to reset, so the
runner keeps a pool per factory and hands one instance to each in-flight rollout (at most
`max_concurrent_rollouts` exist). `reset(**row)` and `get_reward()` are user code that may
block, so both run in the worker's thread pool: a slow environment delays only its own
rollout. With a dict of factories the dataset's `environment` column picks one; that column
is consumed here and never forwarded to `reset`. Public methods other than the reserved
`reset` / `get_reward` become the rollout's tools, so each rollout sees only its own
environment's tools. An instance that a sync call its rollout stopped waiting for still runs
on (a tool past `tool_timeout_s`, a `reset` / `get_reward` / tool cancelled with its rollout)
is dropped, not pooled: a thread cannot be stopped, so the next rollout would see its state
change under it; a fresh instance is built when one is needed (`RolloutThreadPool` bounds how
many such calls there can be). Its own rollout, whose transcript says the call failed, is left
unscored by the environment (`finish` skips `get_reward`).
"""
from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from grpo_agent.error_text import error_text
from grpo_agent.plugins.schemas import public_tool_names
from grpo_agent.rollout.concurrency import RolloutThreadPool
from grpo_agent.rollout.scoring import checked_reward

logger = logging.getLogger(__name__)

ROUTING_COLUMN = "environment"


class EnvironmentEpisodeError(RuntimeError):
    """An environment's `reset` or `get_reward` raised (a task it cannot load, its server gone
    mid-episode): costs its group, not the run (`rollout/group_failures.py`)."""


class EnvironmentResetError(EnvironmentEpisodeError):
    """`reset` raised."""


class EnvironmentRewardError(EnvironmentEpisodeError):
    """`get_reward` raised."""


@dataclass
class EnvEpisode:
    """One rollout's environment: the instance, its prompt, its tools and timings."""

    env: Any
    prompt: list[dict[str, Any]]
    tools: list[Callable]
    reset_s: float
    pool_key: str
    reward_s: float | None = None
    metrics: dict[str, list[float]] = field(default_factory=dict)


def environment_tools(env: Any) -> list[Callable]:
    """The env's tool methods (`public_tool_names`), bound, in definition order."""
    return [getattr(env, name) for name in public_tool_names(type(env))]


def build_prompt(row: dict[str, Any], reset_text: str | None) -> list[dict[str, Any]]:
    """Combine the row's prompt and reset()'s text the way the spec describes.

    With a prompt in the row, reset's text is appended to the last user message; without
    one, reset's text becomes the user prompt.
    """
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if prompt is None:
        if reset_text is None:
            raise ValueError(
                "The environment's reset() returned None and the dataset row has no 'prompt' "
                "column: return the task text from reset() or add a 'prompt' column."
            )
        return [{"role": "user", "content": reset_text}]
    messages = copy.deepcopy(list(prompt))
    if reset_text is not None:
        user_turns = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not user_turns:
            messages.append({"role": "user", "content": reset_text})
        else:
            last = messages[user_turns[-1]]
            last["content"] = f"{last['content']}\n\n{reset_text}" if last["content"] else reset_text
    return messages


def agent_only_name(factory: Any) -> str | None:
    """The agent an `agent_only` env (verifiers) is played by, whether `factory` is its class,
    a `functools.partial` of it (options bound) or its `EnvironmentSpec`; None otherwise."""
    for candidate in (factory, getattr(factory, "func", None), getattr(factory, "factory", None)):
        if isinstance(name := getattr(candidate, "agent_only", None), str) and name:
            return name
    return None


class EnvironmentRunner:
    """Hands out pooled environment instances per rollout and collects their rewards."""

    def __init__(self, factory: Callable | dict[str, Callable], executor: ThreadPoolExecutor):
        if isinstance(factory, dict):
            if not factory:
                raise ValueError("environment_factory is an empty dict: map at least one name to a factory.")
            self._factories = dict(factory)
            self._routed = True
        else:
            if not callable(factory):
                raise TypeError(
                    f"environment_factory must be a class/callable or a dict of them, got {factory!r}."
                )
            self._factories = {getattr(factory, "__name__", "environment"): factory}
            self._routed = False
        self._executor = executor
        self._idle: dict[str, list[Any]] = {key: [] for key in self._factories}

    def _route(self, row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Pick the factory key for a row and the keyword arguments for reset()."""
        if not self._routed:
            return next(iter(self._factories)), dict(row)
        kwargs = {k: v for k, v in row.items() if k != ROUTING_COLUMN}
        name = row.get(ROUTING_COLUMN)
        if name is None:
            raise KeyError(
                f"environment_factory is a dict ({sorted(self._factories)}) but the dataset row "
                f"has no '{ROUTING_COLUMN}' column: add one naming the environment for each row."
            )
        if name not in self._factories:
            raise KeyError(
                f"Row asks for environment {name!r}, which is not in environment_factory "
                f"(known: {sorted(self._factories)})."
            )
        return name, kwargs

    async def _run(self, fn: Callable, *args, **kwargs) -> Any:
        """Await `fn` when it is a coroutine function, else run it in the worker's thread pool;
        cancelled there, its instance stays busy until the thread returns (`_give_back`) and
        its thread counts as held (`RolloutThreadPool.hold`)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        call = self._executor.submit(functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wrap_future(call)
        except asyncio.CancelledError:
            if isinstance(self._executor, RolloutThreadPool):
                self._executor.busy_until_done(getattr(fn, "__self__", None), call)
                self._executor.hold(getattr(fn, "__qualname__", repr(fn)), call, None, cancelled=True)
            raise

    def abandon(self, episode: EnvEpisode) -> None:
        """The episode's rollout ended without `finish` (cancelled, or it raised): forget its
        instance (not pooled: a call may still run on it)."""
        if isinstance(self._executor, RolloutThreadPool):
            self._executor.unwatch(episode.env)

    def _give_back(self, key: str, env: Any) -> None:
        """Pool `env` again, unless a call its rollout stopped waiting for still runs on it."""
        if not (isinstance(self._executor, RolloutThreadPool) and self._executor.is_busy(env)):
            self._idle[key].append(env)

    async def start(self, row: dict[str, Any]) -> EnvEpisode:
        """Take (or build) an instance, reset it with the row and build the rollout's prompt."""
        key, kwargs = self._route(row)
        if isinstance(self._executor, RolloutThreadPool):  # not in `_run`: reset wraps its errors
            self._executor.check_held()
        env = self._idle[key].pop() if self._idle[key] else await self._run(self._factories[key])
        started = time.perf_counter()
        try:
            reset_text = await self._run(env.reset, **kwargs)
        except Exception as error:
            self._give_back(key, env)
            raise EnvironmentResetError(
                f"{type(env).__name__}.reset() raised {error_text(error)}") from error
        except BaseException:  # cancelled
            self._give_back(key, env)
            raise
        reset_s = time.perf_counter() - started
        if reset_text is not None and not isinstance(reset_text, str):
            self._give_back(key, env)
            raise TypeError(
                f"{type(env).__name__}.reset() returned {type(reset_text).__name__} ({reset_text!r:.80}); "
                "it must return the task text (a str) or None."
            )
        prompt = build_prompt(row, reset_text)
        episode = EnvEpisode(
            env=env, prompt=prompt, tools=environment_tools(env), reset_s=reset_s, pool_key=key,
            metrics={"env/reset_s": [reset_s]},
        )
        if isinstance(self._executor, RolloutThreadPool):  # its tools' late calls, for `finish`
            self._executor.watch(env)
        return episode

    async def finish(self, episode: EnvEpisode) -> tuple[type, float] | None:
        """Score the episode with `get_reward()` (if defined) and return the env to its pool.

        Returns `(env class, reward)`; the class names the reward source. An exception from
        `get_reward` is raised as `EnvironmentRewardError` after the instance has gone back to
        the pool (dropped instead while a timed-out or cancelled call still runs on it).
        Returns None (the env leaves the rollout unscored) when one of the episode's own tool
        calls timed out: its thread went on writing to the instance, so `get_reward` would
        read a state the transcript (where the call failed) does not show, or read it mid-write.
        Such rollouts are counted in `env/late_call_unscored_count` (0 for those it scores).
        """
        get_reward = getattr(episode.env, "get_reward", None)
        late = (self._executor.unwatch(episode.env)
                if isinstance(self._executor, RolloutThreadPool) else [])
        try:
            if get_reward is None:
                return None
            episode.metrics["env/late_call_unscored_count"] = [float(bool(late))]
            if late:
                _warn_unscored(type(episode.env).__name__, late[0])
                return None
            started = time.perf_counter()
            try:
                reward = await self._run(get_reward)
            except Exception as error:
                raise EnvironmentRewardError(
                    f"{type(episode.env).__name__}.get_reward() raised {error_text(error)}") from error
            episode.reward_s = time.perf_counter() - started
            episode.metrics["env/reward_s"] = [episode.reward_s]
            who = f"{type(episode.env).__name__}.get_reward()"
            return type(episode.env), checked_reward(reward, who)
        finally:
            self._give_back(episode.pool_key, episode.env)


_warned_unscored: set[tuple[str, str]] = set()


def _warn_unscored(env_name: str, tool: str) -> None:
    """Once per environment and tool: a rollout left unscored for a late tool call."""
    if (env_name, tool) in _warned_unscored:
        return
    _warned_unscored.add((env_name, tool))
    logger.warning(
        "%s.get_reward() was not called for a rollout whose %r call timed out (tool_timeout_s): "
        "the call's thread went on changing the instance, so the reward would read a state the "
        "rollout's transcript does not show. The environment leaves such rollouts unscored "
        "(said once; tools/%s/failure_count counts each such timeout). Make %r return within "
        "tool_timeout_s, or make it `async def`.", env_name, tool, tool, tool)
