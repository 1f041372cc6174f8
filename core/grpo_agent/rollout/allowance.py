"""Staleness in one place: the token allowance, the drop-at-pull rule, the staleness-0 cases.

Design decision: the spec bounds staleness twice. At pull time a sample more than
`max_staleness` model versions old is dropped (its prompt counts as consumed, once per group),
and again when a step's carry (pulled, but past the step's rows) opens the next step.
Before that, the dispatcher starts a group only while the tokens queued and in flight stay
below a cumulative allowance: the tokens the trainer has pulled plus `max(max_staleness, 1)`
steps' worth, so generation runs at most that far ahead of training. Under max_staleness=0
every group must finish on the version that trains it: the window counts from the end of the
last step instead of sliding with each pull, and admission is held from taking a step's
samples until its weight push. `TokenAllowance` is the trainer's side (it lives in the
`RolloutWorker`), `has_room` the dispatcher's; both are pure, so tests call them directly.

Design decision: the spec's window is an upper bound ("at most"), and the window in use adapts
below it. A full window keeps the pool of queued and in-flight tokens full, so by Little's law
every sample spends about that many steps between its dispatch and its pull: staleness sits at
the bound and the tail is dropped. Measured on issue 21's task (max_staleness=4, idle 2-core
box): 0.18-0.36 generated tokens per trained token dropped stale with the full window, none at
half or three quarters of it, at the same generation rate. So when a step pulled a sample at
the bound (or dropped one), the window shrinks by `WINDOW_SHRINK`; after a step without, it
grows back by `WINDOW_GROW` of the spec's window, never below one step's worth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from grpo_agent.metrics import Observation
from grpo_agent.types import PromptConsumed, TrainingSample

HELD = -1.0  # the published value while admission is held: start no group
WINDOW_SHRINK = 0.8  # the window in use after a step that met the staleness bound
WINDOW_GROW = 0.05  # share of the spec's window given back after a step that did not


def initial_step_tokens(token_budget: int, grad_accum_steps: int, world_size: int) -> int:
    """Tokens of one step of full rows, assumed until the trainer reports a real step."""
    return token_budget * grad_accum_steps * max(world_size, 1)


@dataclass
class TokenAllowance:
    """The trainer's side: slides with pulls and steps, drops stale samples at pull."""

    max_staleness: int
    step_tokens: int  # the last step's forwarded tokens (full rows until the first step)
    consumed: int = 0  # forwarded tokens pulled so far, stale ones too
    base: int = 0  # max_staleness=0: `consumed` when the last step ended
    held: bool = False
    measured: bool = False  # a step reported its tokens (`after_step`); before, full rows
    window_frac: float = 1.0  # share of the spec's window in use (see the module doc)
    _met_bound: bool = False  # a sample pulled since the last step was at the bound or dropped
    _stale_groups: set[int] = field(default_factory=set)

    @property
    def window_tokens(self) -> int:
        steps = max(self.max_staleness, 1)
        return round(self.window_frac * steps * max(int(self.step_tokens), 1))

    def value(self) -> float:
        """The cumulative allowance the dispatcher compares its committed tokens with (`HELD`
        while held). Under max_staleness=0 it counts from the end of the last step, so pulls
        while a step fills do not admit the next step's groups, which would arrive stale."""
        if self.held:
            return HELD
        base = self.base if self.max_staleness == 0 else self.consumed
        return float(base + self.window_tokens)

    def hold(self) -> None:
        self.held = True

    def assume_step(self, tokens: int) -> None:
        """A new assumed step (full rows of a budget that followed a restored server); a
        step's measured tokens stay."""
        if not self.measured:
            self.step_tokens = int(tokens)

    def after_step(self, tokens: int) -> None:
        """The forwarded tokens the last step used; called after its push, so it ends a hold.
        The window in use shrinks if the step's samples met the staleness bound, else grows."""
        self.step_tokens, self.measured = int(tokens), True
        self.base, self.held = self.consumed, False
        floor = 1.0 / max(self.max_staleness, 1)  # one step's worth
        if self._met_bound:
            self.window_frac = max(floor, self.window_frac * WINDOW_SHRINK)
        else:
            self.window_frac = min(1.0, self.window_frac + WINDOW_GROW)
        self._met_bound = False

    def after_pull(self, items: list, version: int, now: float) -> tuple[list, list[Observation]]:
        """Drop samples more than max_staleness versions behind `version`; the first dropped
        sample of a group becomes a "stale" notice (the prompt is consumed, untrained).
        Returns the kept items and the staleness observations."""
        self.consumed += sum(item.num_tokens for item in items if isinstance(item, TrainingSample))
        return self._keep_fresh(items, version, now)

    def recheck_carry(self, samples: list, version: int) -> tuple[list, list[Observation]]:
        """The same rule for a step's carry (pulled fresh, then a step and its push went by).
        Its samples were counted and observed at their pull; only new drops are counted."""
        return self._keep_fresh(samples, version, None)

    def _keep_fresh(self, items: list, version: int, now: float | None) -> tuple[list, list[Observation]]:
        kept: list = []
        observations: list[Observation] = []
        dropped = 0
        for item in items:
            if not isinstance(item, TrainingSample):
                kept.append(item)
                continue
            staleness = version - item.model_version
            self._met_bound |= staleness >= self.max_staleness
            if staleness > self.max_staleness:
                dropped += 1
                if item.group_id not in self._stale_groups:
                    self._stale_groups.add(item.group_id)
                    kept.append(PromptConsumed(item.prompt_index, item.row_index, "stale"))
                continue
            if now is not None:  # its staleness: where a step takes it (`StepSource`)
                observations.append(("sample/time_in_queue_s", now - item.queued_at))
            kept.append(item)
        observations.append(("sample/dropped_stale_count", float(dropped)))
        if now is not None:
            observations.append(("rollout/staleness_window_frac", self.window_frac))
        return kept, observations


def has_room(value: float, *, max_staleness: int, queued_tokens: int, groups_in_flight: int,
             groups_done: int, group_tokens_total: int) -> bool:
    """The dispatcher's rule: may one more group start under the published allowance `value`?

    Committed tokens are those queued for the trainer plus the expected tokens of the groups in
    flight (the mean group so far). Before any group finished, groups start one at a time."""
    if value == HELD:
        return False
    if groups_done == 0:
        return groups_in_flight == 0
    committed = queued_tokens + groups_in_flight * (group_tokens_total / groups_done)
    if committed < value:
        return True
    # max_staleness=0 admits one step of tokens per model version. A step can need more than
    # the last one did; with nothing in flight the trainer is still filling it (it would have
    # held admission otherwise), so one more group may start.
    return max_staleness == 0 and groups_in_flight == 0


def holds_before_push(max_staleness: int) -> bool:
    """Whether admission is held from taking a step's samples until its weight push: under
    max_staleness=0 a group started then is stale before it can be trained."""
    return max_staleness == 0
