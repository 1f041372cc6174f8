"""The spec's pass-rate curriculum as a prompt filter plus an advantage estimator.

Use with `advantage_estimator="curriculum"` and `prompt_filters=["curriculum"]`; the cap is the
option `pass_rate_cap` (`--plugin-arg curriculum.pass_rate_cap=0.8`, or
`plugin_args={"curriculum": {"pass_rate_cap": 0.8}}`). The estimator records each prompt's pass
rate (fraction of scored rollouts with reward > 0) and returns the built-in group-normalised
advantages; the filter skips prompts whose recorded pass rate reached the cap. Design decision:
both run inside the rollout worker process, so they share the `PASS_RATES` table there without
any cross-process plumbing (it is that process's state, not a setting).
"""
from __future__ import annotations

from grpo_agent import Option, advantage_estimator, hookimpl, prompt_filter
from grpo_agent.advantages import group_norm

PASS_RATE_CAP = Option(
    "pass_rate_cap", float, 0.9, "skip a prompt once its recorded pass rate reaches this"
)

PASS_RATES: dict[int, float] = {}


@prompt_filter("curriculum", options=[PASS_RATE_CAP])
def below_pass_rate_cap(row_index: int, row: dict, epoch: int, *, pass_rate_cap: float) -> bool:
    """Keep a prompt until its recorded pass rate reaches the cap."""
    return PASS_RATES.get(row_index, 0.0) < pass_rate_cap


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
