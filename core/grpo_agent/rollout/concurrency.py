"""How many rollouts may run at once: the live vLLM load cap and the slot limiter.

Design decision: the cap follows the spec's rule exactly and is a pure state machine
(`ConcurrencyCap.update`), so the rule is unit-tested without a server; the worker feeds it a
`/metrics` poll every 5 s. It starts at what the KV cache holds at full length
(KV tokens / `max_model_len`), grows by 25 % while usage stays under 60 % with nothing waiting
(at most once per cap's worth of completed rollouts), and shrinks by 30 % above 80 % usage:
running rollouts finish, new ones wait. `max_concurrent_rollouts` bounds it always, and is the
cap itself when the server exposes no `/metrics`.
"""
from __future__ import annotations

import asyncio
import math

from grpo_agent.sampler.prometheus import ServerMetrics

POLL_INTERVAL_S = 5.0
GROW_BELOW_USAGE = 0.60
SHRINK_ABOVE_USAGE = 0.80
GROW_FACTOR = 1.25
SHRINK_FACTOR = 0.70


class ConcurrencyCap:
    """The spec's adaptive cap on in-flight rollouts."""

    def __init__(self, max_concurrent_rollouts: int, kv_tokens: int | None, max_model_len: int):
        self.limit = max_concurrent_rollouts
        if kv_tokens is None:
            self.value = max_concurrent_rollouts
            self.adaptive = False
        else:
            self.value = max(1, min(self.limit, kv_tokens // max(max_model_len, 1)))
            self.adaptive = True
        self._completed_at_last_growth = 0

    def update(self, metrics: ServerMetrics | None, completed_rollouts: int) -> int:
        """Apply one poll's reading; `completed_rollouts` is the running total so far."""
        if not self.adaptive or metrics is None:
            return self.value
        if metrics.kv_cache_usage > SHRINK_ABOVE_USAGE:
            self.value = max(1, math.floor(self.value * SHRINK_FACTOR))
        elif (
            metrics.kv_cache_usage < GROW_BELOW_USAGE
            and metrics.waiting == 0
            and completed_rollouts - self._completed_at_last_growth >= self.value
            and self.value < self.limit
        ):
            self.value = min(self.limit, max(self.value + 1, math.floor(self.value * GROW_FACTOR)))
            self._completed_at_last_growth = completed_rollouts
        return self.value


class RolloutSlots:
    """An asyncio limiter whose size can change while rollouts hold slots."""

    def __init__(self, cap: ConcurrencyCap):
        self.cap = cap
        self.in_flight = 0
        self.promised = 0  # rollouts dispatched that have not taken their slot yet
        self._changed = asyncio.Condition()

    def has_free_slot(self) -> bool:
        return self.in_flight < self.cap.value

    def can_dispatch(self) -> bool:
        """Room for more work: counts rollouts already dispatched but not yet running."""
        return self.in_flight + self.promised < self.cap.value

    def promise(self, rollouts: int) -> None:
        """Called synchronously at dispatch, so the dispatcher sees the work it just created."""
        self.promised += rollouts

    def withdraw(self, rollouts: int) -> None:
        """Rollouts cancelled before they took their slot (their group was dropped)."""
        self.promised = max(self.promised - rollouts, 0)

    async def acquire(self) -> int:
        """Take a slot (fulfilling a promise); returns the number in flight including this one."""
        async with self._changed:
            await self._changed.wait_for(self.has_free_slot)
            self.promised = max(self.promised - 1, 0)
            self.in_flight += 1
            return self.in_flight

    async def release(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

    async def cap_changed(self) -> None:
        async with self._changed:
            self._changed.notify_all()
