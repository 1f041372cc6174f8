"""The tool calls of a rollout that does not finish, readable after it was cancelled or raised.

Design decision: a rollout's observations travel in the `Rollout` it returns (`Rollout.metrics`),
so one that never returns (cancelled with its dropped group or at the run's end, or raising the
error that drops its group) took its tool calls and their failures with it, though they
happened and the spec counts every one in `tools/*`. The engine hands each rollout a
`CallsSoFar` through a context variable, so the hooks keep the spec's signatures; the tool loop
and an agent run's gateway session register a reader of their counts as they start, and the
engine reads it only for a rollout that did not return (one that did logs its own
`Rollout.metrics`), so each call is counted once.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from grpo_agent.metrics import Observation

Reader = Callable[[], list[Observation]]


class CallsSoFar:
    """One rollout's tool calls so far: `observations()` reads every registered reader now."""

    def __init__(self) -> None:
        self._readers: list[Reader] = []

    def add(self, read: Reader) -> None:
        self._readers.append(read)

    def observations(self) -> list[Observation]:
        return [observation for read in self._readers for observation in read()]


_CURRENT: contextvars.ContextVar[CallsSoFar | None] = contextvars.ContextVar("calls_so_far",
                                                                             default=None)


@contextlib.contextmanager
def recording(calls: CallsSoFar) -> Iterator[None]:
    """Run the current rollout (and the tasks it starts) with `calls` as its record."""
    token = _CURRENT.set(calls)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def record(read: Reader) -> None:
    """Let the engine running the current rollout call `read` should the rollout not return;
    nothing outside an engine's rollout (an evaluation, a test calling the tool loop)."""
    calls = _CURRENT.get()
    if calls is not None:
        calls.add(read)
