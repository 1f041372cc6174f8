"""`check_environment`: what `grpo-agent env check NAME` runs against a registered env.

Design decision: a checker reports every step instead of stopping at the first failure, so it
catches the env's own exceptions per step and records them as failed steps. It instantiates
the env, resets it on sample rows, calls each tool with the env's example arguments, and
scores the env's gold answer with the same reward sources a training run would sum. An env
class with `agent_only = "AGENT"` has no reset (its registered agent plays the rows against a
model), so only its dataset and declarations are checked and the report says how to check more.
"""
from __future__ import annotations

import asyncio
import inspect
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_agent.plugins.registry import EnvironmentSpec, Registry, scores_itself


class NoGoldAnswer(Exception):
    """Raised by an env's `gold(env, row)` for a row with no reference answer (a task with many
    valid answers); `env check` reports the step as skipped instead of failed."""


@dataclass
class CheckStep:
    """One check: what was checked, whether it passed, and what was seen."""

    name: str
    ok: bool
    detail: str = ""


def _run_step(steps: list[CheckStep], name: str, action: Callable[[], str]) -> Any:
    try:
        steps.append(CheckStep(name, True, action()))
    except Exception as err:  # noqa: BLE001 -- the checker reports env failures as steps
        steps.append(CheckStep(name, False, f"{type(err).__name__}: {err}"))


def _await(value: Any) -> Any:
    return asyncio.run(value) if inspect.isawaitable(value) else value


def sample_rows(spec: EnvironmentSpec, num_rows: int) -> list[dict[str, Any]]:
    """The first rows of the env's dataset, or empty rows for a self-sampling env."""
    dataset = spec.load_dataset()
    if dataset is None:
        return [{} for _ in range(num_rows)]
    return [dict(dataset[i]) for i in range(min(num_rows, len(dataset)))]


def score_gold(spec: EnvironmentSpec, registry: Registry, row: dict[str, Any]) -> float:
    """Total reward of the env's gold answer on one row (rewards + `get_reward`)."""
    env = spec()
    env.reset(**row)
    completion = spec.gold(env, row)
    total = 0.0
    if completion is not None:
        columns = {key: [value] for key, value in row.items() if key != "prompt"}
        for fn in spec.reward_funcs(registry):  # their declared options bound (defaults)
            scores = _await(fn(prompts=[row.get("prompt")],
                               completions=[[{"role": "assistant", "content": completion}]],
                               completion_ids=[[]], **columns))
            total += scores[0] or 0.0
    if callable(getattr(env, "get_reward", None)):
        total += float(_await(env.get_reward()))
    return total


def check_environment(spec: EnvironmentSpec, registry: Registry, num_rows: int = 2) -> list[CheckStep]:
    """Run every check on `spec`; the env passes when all steps are ok."""
    steps: list[CheckStep] = []
    rows: list[dict[str, Any]] = []

    def load() -> str:
        rows.extend(sample_rows(spec, num_rows))
        return f"{len(rows)} sample row(s)" + ("" if spec.dataset else " (self-sampled in reset)")

    _run_step(steps, "dataset", load)
    _run_step(steps, "tool schemas", lambda: _schema_names(spec))
    agent = getattr(spec.factory, "agent_only", None)
    _run_step(steps, "rewards", lambda: _reward_sources(spec, registry, agent))
    if agent:  # its episodes need a model: nothing to reset, call or score here
        steps.append(CheckStep("episodes", True, (
            f"not checked here: {spec.name!r} is agent-only (the {agent!r} agent plays each row "
            f"against a model); check its episodes with a short run: grpo-agent train --env "
            f"{spec.name}{_env_args(spec)} --agent {agent} --set max_steps=1 --vllm-url URL")))
        return steps
    for i, row in enumerate(rows):
        _run_step(steps, f"reset row {i}", lambda row=row: _check_reset(spec, row))
        for tool, args in spec.tool_examples.items():
            _run_step(steps, f"tool {tool}({args}) row {i}",
                      lambda row=row, tool=tool, args=args: _call_tool(spec, row, tool, args))
        if spec.gold is not None:
            _run_step(steps, f"gold answer row {i}", lambda row=row: _check_gold(spec, registry, row))
    return steps


def _reward_sources(spec: EnvironmentSpec, registry: Registry, agent: str | None) -> str:
    """What scores the env's rollouts; none at all fails (it said "get_reward only" for an env
    without get_reward, whose `train --env` run then dropped every group as unscored)."""
    names = ", ".join(getattr(registry.resolve_reward(r), "__name__", str(r)) for r in spec.rewards)
    if names:
        return names
    if agent:
        return f"the {agent!r} agent's own score"
    if scores_itself(spec.factory):
        return "get_reward only"
    raise ValueError("no reward source: declare rewards=[...] in @environment(...) or define "
                     "get_reward(); `grpo-agent train --env` would score no rollout.")


def _env_args(spec: EnvironmentSpec) -> str:
    """The `--env-arg` flags that rebuild this spec's options (those set away from their default),
    so a suggested command runs the env as it was checked."""
    defaults = {option.name: option.default for option in spec.options}
    given = {name: value for name, value in spec.option_values.items()
             if name not in defaults or value != defaults[name]}
    return "".join(f" --env-arg {shlex.quote(f'{name}={value}')}" for name, value in given.items())


def _schema_names(spec: EnvironmentSpec) -> str:
    return ", ".join(schema["function"]["name"] for schema in spec.tool_schemas()) or "no tools"


def _check_reset(spec: EnvironmentSpec, row: dict[str, Any]) -> str:
    prompt = spec().reset(**row)
    if prompt is None and "prompt" not in row:
        raise ValueError("reset() returned None and the row has no 'prompt' column: no prompt.")
    return repr(prompt if prompt is not None else row["prompt"])[:100]


def _call_tool(spec: EnvironmentSpec, row: dict[str, Any], tool: str, args: dict) -> str:
    env = spec()
    env.reset(**row)
    return f"returned {_await(getattr(env, tool)(**args))!r}"[:100]


def _check_gold(spec: EnvironmentSpec, registry: Registry, row: dict[str, Any]) -> str:
    try:
        total = score_gold(spec, registry, row)
    except NoGoldAnswer as why:
        return f"skipped: {why}"
    if total <= 0:
        raise ValueError(f"the gold answer scored {total}; expected a positive reward.")
    return f"reward {total}"
