"""Which model version a rollout samples with: pinned per task, inherited by the tasks it starts.

Design decision: a group's rollouts must all sample the policy the group started under, even
when the trainer pushes a newer one mid-group (under LoRA sync each version is its own served
adapter). A context variable carries that version down the await chain without threading it
through every hook's signature: the engine pins a group, evaluation the version it evaluates,
the agent gateway each call's session, and `generate_one_turn` reads it.
"""
from __future__ import annotations

import contextvars

_ROLLOUT_VERSION: contextvars.ContextVar[int] = contextvars.ContextVar("rollout_version")


def pin_rollout_version(version: int) -> None:
    """Make `version` the policy of the current task and of every task it creates from now on."""
    _ROLLOUT_VERSION.set(version)


def rollout_version() -> int | None:
    """The version pinned for the current task, or None outside a rollout."""
    return _ROLLOUT_VERSION.get(None)


class VersionValue:
    """Stands in for the worker's shared model-version value where there is no worker
    (evaluation pins the version it evaluates; tests)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
