"""The trainer's no-progress stop: a run whose groups are all dropped must not wait forever.

Design decision: stage deadlines (grpo_agent/stall.py) catch a stage that hangs; they cannot
catch a pipeline where every stage finishes but nothing trains (every group zero-std, every
reward failing). The queue pull sees each group's fate as it arrives, so the guard lives on
the trainer's side of the queue and reports through the same stall watch.
"""
from __future__ import annotations

import logging
import time

from grpo_agent.stall import REPORT_NAME, StageStalled, StallWatch

logger = logging.getLogger(__name__)

NO_PROGRESS_WINDOW_GROUPS = 8
# After the run's first warning, a later all-dropped window warns again only once this long has
# passed without a trainable sample: a run that trains while most groups are dropped (a demo
# nearing saturation) otherwise logged it every few groups, each "for 0 s".
REWARN_IDLE_S = 60.0
DROPPED_REASONS = ("zero_std", "reward_error", "stalled", "agent_error", "unscored", "oversize_sample")
GREEDY_CAUSE = ("temperature=0 samples greedily, so every rollout of a group is the same completion "
                "and, unless the env or its reward is random, gets the same reward (set temperature "
                "> 0, e.g. --set temperature=1.0)")


def greedy_sampling_warning(temperature: float) -> str | None:
    """The start warning of a training run at temperature 0, or None.

    Warned, not refused: an env whose tools or reward are random still gives a group reward
    variance from identical completions; on a deterministic one every group is dropped as
    zero_std, and without this the run said so only at its no-progress warning."""
    if temperature != 0:
        return None
    return (f"Training at {GREEDY_CAUSE}: each such group is dropped (zero reward std), and a run "
            "with no trainable group stops at no_progress_timeout.")


class NoProgressStalled(StageStalled):
    """No group trained for `no_progress_timeout`: the fix is the cause, not a longer deadline."""


class NoProgressGuard:
    """The trainer's no-progress stall: every group of a whole window dropped, no sample.

    Why: a run whose model never produces reward variance waits without bound (env-owned data
    has no epoch end). Once `NO_PROGRESS_WINDOW_GROUPS` groups in a row are dropped it says so
    with the likely cause; after `timeout_s` without a trainable sample it writes the stall
    report and raises `StageStalled` (0 = only warn)."""

    def __init__(self, timeout_s: float, watch: StallWatch | None,
                 temperature: float | None = None) -> None:
        """`temperature`: the run's sampling temperature; 0 is named as the likely cause."""
        self.timeout_s = float(timeout_s)
        self.temperature = temperature
        self.watch = watch
        self.last_progress = time.monotonic()
        self.dropped: dict[str, int] = {}  # groups, by reason
        self._groups_seen: set[int] = set()  # with a sample since the last trainable one
        self._warned = False
        self._warned_before = False  # any warning this run: later ones wait REWARN_IDLE_S
        self._trained_any = False  # before a first trainable sample, "for 0 s" misleads

    @property
    def dropped_in_a_row(self) -> int:
        return sum(self.dropped.values())

    def record(self, reason: str | None, group: int | None = None) -> None:
        """`reason` of a `PromptConsumed` notice, or of a sample of `group`: None when it is
        trainable, "oversize_sample" when it is not. A group counts once however many of its
        samples are oversize, and not at all if one of them trained: the window and the cause
        count groups (per sample, a run said "the last 839 groups were all dropped" of 127
        groups and 712 samples)."""
        if reason is None:
            self.last_progress, self.dropped, self._warned = time.monotonic(), {}, False
            self._trained_any = True
            self._groups_seen = {group}
            return
        if group is not None:
            if group in self._groups_seen:
                return
            self._groups_seen.add(group)
        if reason in DROPPED_REASONS:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def check(self) -> None:
        if self.dropped_in_a_row < NO_PROGRESS_WINDOW_GROUPS:
            return
        idle = time.monotonic() - self.last_progress
        if not self._warned and (not self._warned_before or idle >= REWARN_IDLE_S):
            self._warned = self._warned_before = True
            logger.warning("No progress: %s", self.cause(idle))
        if self.timeout_s > 0 and idle > self.timeout_s:
            message = (f"{self.cause(idle)} Stopping after no_progress_timeout={self.timeout_s:g} s "
                       "(raise it, or 0 to wait without bound).")
            if self.watch is not None:
                self.watch.report_stall("no_progress", {"dropped_groups": dict(self.dropped)},
                                        self.timeout_s, self.last_progress,
                                        setting="no_progress_timeout", cause=message)
                message += f" See {self.watch.output_dir / REPORT_NAME}."
            raise NoProgressStalled(message)

    def cause(self, idle: float) -> str:
        """What was dropped since the last trainable sample, and the likely causes."""
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items()))
        likely = []
        if self.dropped.get("zero_std") and self.temperature == 0:
            likely.append(GREEDY_CAUSE)
        elif self.dropped.get("zero_std"):
            likely.append("every rollout of a group gets the same reward: the model never produces "
                          "reward variance (check the reward functions and the tools, use easier or "
                          "harder prompts, or warm the model up)")
        if self.dropped.get("agent_error"):
            likely.append("the agent program fails on (nearly) every rollout, so no group has two "
                          "scored rollouts (see harness/errors_count and the 'Rollout dropped' "
                          "warnings, which say why: a command that cannot start, an exception, a "
                          "reply that is not a number)")
        if self.dropped.get("unscored"):
            likely.append("nothing scores the rollouts: every reward function returned None for "
                          "them, or the agent returns None and there are no reward_funcs (return "
                          "a float from the agent, or pass reward_funcs that score the completion)")
        if self.dropped.get("reward_error"):
            likely.append("the reward functions fail (see rollout/reward_error_count and the worker log)")
        if self.dropped.get("stalled"):
            likely.append("rollouts pass their stage deadlines (see stall_report.json)")
        if self.dropped.get("oversize_sample"):
            likely.append("the samples are longer than token_budget, so each is dropped (the "
                          "'Dropping a sample' warnings): raise token_budget (and the server's "
                          "--max-model-len) or shorten rollouts (max_completion_length, "
                          "max_tool_calling_iterations)")
        waited = (f"no trainable sample came for {idle:.0f} s" if self._trained_any
                  else "none of the run's groups has been trainable yet")
        return (f"the last {self.dropped_in_a_row} groups were all dropped ({counts}) and {waited}. "
                f"Likely cause: {'; '.join(likely)}.")
