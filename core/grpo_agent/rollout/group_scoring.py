"""From one finished group's rollouts to training samples: reconcile, reward, advantages.

Design decision: this is the part of the worker that turns rollouts into what trains, and it
holds no dispatch state: the engine (`rollout.engine`) decides when a group runs and keeps
the allowance's books (tokens queued, groups in flight); these functions take a group and
say what came of it (`ScoredGroup`: its samples, or why it has none, and its metric
observations), so the engine's accounting has one home and the scoring rules another.
Blocking work (reconciliation, sync rewards) runs in the loop's `tool_executor`.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from grpo_agent.metrics import Observation
from grpo_agent.rollout import observations
from grpo_agent.rollout.plugins import check_advantages
from grpo_agent.rollout.prompts import PromptSlot
from grpo_agent.rollout.reconcile import reconcile_turns
from grpo_agent.rollout.scoring import (
    RewardFailureTracker,
    RewardFunctionError,
    add_rollout_sources,
    has_signal,
    run_reward_functions,
)
from grpo_agent.rollout.unfinished import CallsSoFar
from grpo_agent.stall import StageStalled
from grpo_agent.types import Rollout, RolloutGroup, TrainingSample, TurnRecord


@dataclass
class ScoredGroup:
    """What scoring made of a group: samples to queue, or `reason` (a `PromptConsumed`
    reason: "zero_std", "agent_error", "unscored", "reward_error", "stalled") when it gives
    none. `stops_run`: the error that stops the run (a reward function failed a window of
    groups in a row); the engine raises it after keeping `observations`, so the run's counts
    include the group that stopped it."""

    samples: list[TrainingSample]
    reason: str | None
    observations: list[Observation] = field(default_factory=list)
    stops_run: RewardFunctionError | None = None


async def build_group(loop, slot: PromptSlot, group_id: int, version: int, results: list,
                      observe: Callable[[str, float], None],
                      observe_rate: Callable[[str, float, float], None]) -> RolloutGroup:
    """The group of `results` ((prompt, rollout, env_reward) per rollout), each rollout's
    turns reconciled into training sequences in the executor."""
    prompts, rollouts, env_rewards = (list(column) for column in zip(*results))
    aio = asyncio.get_running_loop()
    reconciled = await aio.run_in_executor(
        loop.tool_executor, _reconcile_all, [rollout.turns for rollout in rollouts])
    for sequences, stats in reconciled:
        observe("rollout/samples_per_rollout", len(sequences))
        observe_rate("rollout/fork_frac", stats.num_forks, stats.num_transitions)
        for drift in stats.drift_tokens:
            observe("rollout/drift_tokens_mean", drift)
            observe("rollout/drift_tokens_max", drift)
    columns = {k: v for k, v in slot.row.items() if k != "prompt"}
    size = len(rollouts)
    return RolloutGroup(
        prompts=prompts, reward_kwargs={k: [v] * size for k, v in columns.items()},
        completions=[r.completion for r in rollouts],
        completions_ids=[r.completion_ids for r in rollouts],
        completions_sequences=[sequences for sequences, _ in reconciled],
        tool_call_counts=[r.tool_call_count for r in rollouts],
        tool_failure_counts=[r.tool_failure_count for r in rollouts],
        model_version=version, group_id=group_id, row_index=slot.row_index,
        env_rewards=env_rewards, rollout_rewards=[r.reward for r in rollouts],
        queued_at=time.monotonic(), rollouts=rollouts, prompt_index=slot.prompt_index,
    )


async def score_group(loop, group: RolloutGroup, failures: RewardFailureTracker) -> ScoredGroup:
    """Reward `group` with the loop's reward functions (under the "scoring" stage deadline),
    turn rewards into advantages with `loop.compute_advantages`, keep the rollouts with signal.
    The rollouts' own observations (`completions/*`, `tools/*`, ...) are kept whatever becomes
    of the group: a group whose reward hung lost them, and with them its tool failures."""
    seen = rollout_observations(loop, group.rollouts)
    try:
        with loop.stalls.stage("scoring", recover=True, group_id=group.group_id,
                               row_index=group.row_index, rewards=list(loop.reward_funcs)):
            scores, failure = await run_reward_functions(loop.reward_funcs, group, loop.tool_executor)
    except StageStalled:  # the hung reward's thread is abandoned; the group is unscored
        return ScoredGroup([], "stalled", seen)
    if failure is not None:
        seen.append(("rollout/reward_error_count", 1.0))
    try:
        failures.record(list(loop.reward_funcs), failure)
    except RewardFunctionError as error:
        return ScoredGroup([], "reward_error", seen, stops_run=error)
    if failure is not None:
        return ScoredGroup([], "reward_error", seen)
    add_rollout_sources(scores, group)
    group.rewards = scores.total(len(group.rollouts))
    where = f"{type(loop).__name__}, advantage_estimator={loop.config.advantage_estimator!r}"
    advantages = check_advantages(loop.compute_advantages(group), group.rewards, where)
    kept = has_signal(group.rewards)
    samples = _samples(group, advantages) if kept else []
    per_rollout = [sum(s.rollout_id == r.rollout_id for s in samples) for r in group.rollouts]
    seen += observations.reward_observations(scores, group.rewards, per_rollout, kept)
    seen += observations.sample_observations(samples)
    return ScoredGroup(samples, None if samples else _why_untrained(group), seen)


def rollout_observations(loop, rollouts: list[Rollout]) -> list[Observation]:
    """The rollouts' own observations (`completions/*`, `rollout/turns_*`, `tools/*` where the
    loop has tools, `env/*`), whatever becomes of their group: scored, or dropped (the spec
    counts a dropped group's tool calls in `tools/failure_frequency`)."""
    return observations.completion_observations(
        rollouts, with_tools=_logs_tools(loop), with_tool_failures=loop.runs_tools)


def unfinished_observations(loop, calls: list[CallsSoFar]) -> list[Observation]:
    """The tool calls of rollouts that did not return (`rollout.unfinished`) under the rules
    `rollout_observations` applies: `tools/*` only where the loop logs them, no failure
    frequency where it does not run the tools."""
    seen = [observation for record in calls for observation in record.observations()]
    if not seen or not _logs_tools(loop):
        return []
    return [(name, value) for name, value in seen
            if loop.runs_tools or name != "tools/failure_frequency"]


def _logs_tools(loop) -> bool:
    """The spec logs `tools/*` only when the trainer has tools (the harness gateway's too)."""
    return bool(loop.tools or loop.env_runner or loop.reports_tools)


def _why_untrained(group: RolloutGroup) -> str:
    """A group without samples: "agent_error" when failed agent runs (harness/dropped_frac)
    left fewer than two scored rollouts; "unscored" when no reward source scored any rollout
    (every reward function returned None, or an agent returned None with no reward_funcs);
    else "zero_std" (equal rewards). Kept apart so the trainer's no-progress message names
    the cause instead of blaming the model's reward variance."""
    scored = int(np.sum(~np.isnan(group.rewards)))
    failed = sum(bool(r.metrics.get("harness/dropped_frac", [0.0])[0]) for r in group.rollouts)
    if scored < 2 and failed:
        return "agent_error"
    return "unscored" if scored == 0 else "zero_std"


def _samples(group: RolloutGroup, advantages: np.ndarray) -> list[TrainingSample]:
    """Training samples of a kept group; unscored and zero-advantage rollouts add nothing."""
    samples = []
    for rollout, reward, advantage, sequences in zip(
            group.rollouts, group.rewards, advantages, group.completions_sequences):
        if math.isnan(reward) or advantage == 0:
            continue
        samples += [TrainingSample(
            sequence=sequence, advantage=float(advantage), model_version=group.model_version,
            group_id=group.group_id, row_index=group.row_index, prompt_index=group.prompt_index,
            rollout_id=rollout.rollout_id) for sequence in sequences]
    now = time.time()
    for sample in samples:
        sample.group_num_samples = len(samples)
        sample.queued_at = now
    return samples


def _reconcile_all(turn_lists: list[list[TurnRecord]]) -> list:
    return [reconcile_turns(turns) for turns in turn_lists]
