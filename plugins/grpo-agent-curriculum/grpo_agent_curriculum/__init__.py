"""The spec's pass-rate curriculum as a prompt filter plus an advantage estimator.

Use with `advantage_estimator="curriculum"` and `prompt_filters=["curriculum"]`. The estimator
records each prompt's pass rate (fraction of scored rollouts with reward > 0) and returns the
built-in group-normalised advantages; the filter skips prompts whose recorded pass rate reached
the cap. Design decision: both run inside the rollout worker process, so they share the
module-level `PASS_RATES` table there without any cross-process plumbing (the trainer process
never sees it). The cap comes from `GRPO_AGENT_CURRICULUM_PASS_RATE_CAP` (default 0.9), read
when the filter runs, so the spawned worker inherits it from the launching environment.
"""
from __future__ import annotations

import os

from grpo_agent import advantage_estimator, hookimpl, prompt_filter
from grpo_agent.plugins.builtins import group_norm

CAP_ENV = "GRPO_AGENT_CURRICULUM_PASS_RATE_CAP"
DEFAULT_CAP = 0.9

PASS_RATES: dict[int, float] = {}


def pass_rate_cap() -> float:
    return float(os.environ.get(CAP_ENV, DEFAULT_CAP))


@prompt_filter("curriculum")
def below_pass_rate_cap(row_index: int, row: dict, epoch: int) -> bool:
    """Keep a prompt until its recorded pass rate reaches the cap."""
    return PASS_RATES.get(row_index, 0.0) < pass_rate_cap()


@advantage_estimator("curriculum")
def record_pass_rate(group):
    """Record the group's pass rate for its prompt, then group-normalise as usual."""
    import numpy as np  # lazily: the CLI imports plugins at start-up

    rewards = np.asarray(group.rewards, dtype=float)
    scored = rewards[~np.isnan(rewards)]
    if len(scored):
        PASS_RATES[group.row_index] = float(np.mean(scored > 0))
    return group_norm(group)


@hookimpl
def register_prompt_filters(register):
    register(below_pass_rate_cap)


@hookimpl
def register_advantage_estimators(register):
    register(record_pass_rate)
