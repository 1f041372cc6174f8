"""The metric observations one scored group produces, in `grpo_agent.metrics` tuple format.

Design decision: the worker sends raw observations, never averages, so the trainer's
`MetricWindow` applies the spec's window rules (means over rollouts or samples, sums for
counts, extremes for min/max, rates as totals over totals). Per-sample weighting is done by
repeating an observation once per training sample (`reward_group_std` is "averaged over
training samples"). Ratios with a possibly-empty denominator (tool failure frequency, fork
fraction) travel as rates, so a window with no tool calls reports NaN as the spec says.
"""
from __future__ import annotations

import math

import numpy as np

from grpo_agent.metrics import Observation
from grpo_agent.rollout.scoring import GroupScores
from grpo_agent.types import Rollout, TrainingSample


def generated_length(rollout: Rollout) -> int:
    """Generated tokens the policy is trained on (tool tokens excluded)."""
    total = 0
    for turn in rollout.turns:
        total += len(turn.output_ids) if turn.output_mask is None else sum(turn.output_mask)
    return total


def terminated(rollout: Rollout) -> bool:
    """Whether the last turn ended with EOS (vLLM finish_reason "stop")."""
    return bool(rollout.turns) and rollout.turns[-1].finish_reason == "stop"


def duplicate_flags(rollouts: list[Rollout]) -> list[bool]:
    """True for each rollout that repeats an earlier one of its group token for token."""
    seen: set[tuple[int, ...]] = set()
    flags = []
    for rollout in rollouts:
        key = tuple(token for turn in rollout.turns for token in turn.output_ids)
        flags.append(key in seen)
        seen.add(key)
    return flags


def completion_observations(rollouts: list[Rollout], with_tools: bool,
                            with_tool_failures: bool = True) -> list[Observation]:
    """`completions/*`, `rollout/turns_*`, the rollouts' own metrics and, only when the
    trainer has tools, `tools/*` for one group (the tool loop counts calls either way).
    `with_tool_failures=False` (an agent program runs its own tools): no
    `tools/failure_frequency`, whose 0 would claim calls that nobody here saw fail or succeed."""
    obs: list[Observation] = []
    for rollout, duplicate in zip(rollouts, duplicate_flags(rollouts)):
        length = generated_length(rollout)
        obs += [("completions/mean_length", length), ("completions/min_length", length),
                ("completions/max_length", length),
                ("completions/clipped_ratio", float(not terminated(rollout))),
                ("completions/duplicate_frac", float(duplicate)),
                ("rollout/turns_mean", len(rollout.turns)), ("rollout/turns_max", len(rollout.turns))]
        if terminated(rollout):
            obs += [("completions/mean_terminated_length", length),
                    ("completions/min_terminated_length", length),
                    ("completions/max_terminated_length", length)]
        if with_tools:
            obs.append(("tools/call_frequency", rollout.tool_call_count))
        if with_tools and with_tool_failures:
            obs.append(("tools/failure_frequency",
                        (float(rollout.tool_failure_count), float(rollout.tool_call_count))))
        for name, values in rollout.metrics.items():
            if with_tools or not name.startswith("tools/"):  # the spec: only with tools
                obs += [(name, value) for value in values]
    return obs


def reward_observations(
    scores: GroupScores, rewards: np.ndarray, samples_per_rollout: list[int], kept: bool
) -> list[Observation]:
    """`reward*`, `rewards/{name}/*` and `frac_reward_zero_std` for one scored group."""
    scored = ~np.isnan(rewards)
    num_samples = sum(samples_per_rollout)
    obs: list[Observation] = [("frac_reward_zero_std", float(not kept))]
    obs += [("reward", float(value)) for value in rewards[scored]]
    for name, values in scores.by_source.items():
        obs += [(f"rewards/{name}/mean", float(v)) for v in values[~np.isnan(values)]]
        obs += [(f"rewards/{name}/group_std", _nanstd(values))] * num_samples
    if kept:
        obs += [("reward_group_std", float(rewards[scored].std()))] * num_samples
        for reward, count in zip(rewards, samples_per_rollout):
            obs += [("reward_kept", float(reward))] * count
    else:
        obs += [("reward_dropped", float(value)) for value in rewards[scored]]
    return obs


def _nanstd(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.std()) if len(finite) else math.nan


def sample_observations(samples: list[TrainingSample]) -> list[Observation]:
    """`sample/*` sizes of the samples a kept group sends to the trainer."""
    obs: list[Observation] = []
    for sample in samples:
        obs += [("sample/forwarded_tokens_mean", sample.num_tokens),
                ("sample/forwarded_tokens_max", sample.num_tokens),
                ("sample/trained_tokens_mean", sample.sequence.num_trained)]
    return obs
