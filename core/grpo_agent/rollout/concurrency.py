"""How many rollouts may run at once: the live vLLM load cap, the slot limiter, the thread pool.

Design decision: the cap follows the spec's rule exactly and is a pure state machine
(`ConcurrencyCap.update`), so the rule is unit-tested without a server; the worker feeds it a
`/metrics` poll every 5 s. It starts at what the KV cache holds at full length
(KV tokens / `max_model_len`), grows by 25 % while usage stays under 60 % with nothing waiting
(at most once per cap's worth of completed rollouts), and shrinks by 30 % above 80 % usage:
running rollouts finish, new ones wait. `max_concurrent_rollouts` bounds it always, and is the
cap itself when the server exposes no `/metrics`. The worker's thread pool
(`RolloutThreadPool`) lives here too: it counts the threads that sync calls their rollouts
stopped waiting for (timed out or cancelled) still hold, and knows which objects (environment
instances) such calls still run on.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from grpo_agent.sampler.prometheus import KV_CACHE_USAGE, ServerMetrics

logger = logging.getLogger(__name__)

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
        self._usage_missing_said = False

    def update(self, metrics: ServerMetrics | None, completed_rollouts: int) -> int:
        """Apply one poll's reading; `completed_rollouts` is the running total so far. A
        reading without KV-cache usage moves nothing: read as 0 it grew the cap on every poll,
        up to max_concurrent_rollouts, on a server that does not report it."""
        if not self.adaptive or metrics is None:
            return self.value
        if metrics.kv_cache_usage is None:
            if not self._usage_missing_said:
                self._usage_missing_said = True
                logger.warning(
                    "The vLLM server's /metrics has no %s gauge (renamed, or another server), so "
                    "the concurrency cap stays at %d (of max_concurrent_rollouts=%d) instead of "
                    "following its KV-cache usage (said once).", KV_CACHE_USAGE, self.value,
                    self.limit)
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


class ToolThreadsHeldError(RuntimeError):
    """Sync calls their rollouts stopped waiting for (timed out, or cancelled with the
    rollout) and that never returned hold most of the rollout threads."""


class RolloutThreadPool(ThreadPoolExecutor):
    """The pool for a rollout process's blocking work (sync tools, environments, rewards, chat
    templates) that counts the threads still held by sync calls their rollouts stopped
    waiting for.

    A thread cannot be stopped, so a sync tool that always hangs takes the pool one timed-out
    call at a time; then every rollout waits for a thread and the run ended only at
    `no_progress_timeout` (30 min), naming nothing. A call cancelled with its rollout (its
    group stalled or dropped: an environment's `reset` past its deadline) keeps its thread the
    same way. Both are counted (`hold`); once they hold more than half the threads, a timed-out
    call's `hold` or the next sync tool or environment call's `check_held` raises
    `ToolThreadsHeldError` naming the call and the fix. A cancelled call's `hold` only counts:
    it runs while its rollout is torn down, where a raise would be swallowed.

    Such a call also keeps running on its tool's instance (an environment's bound method):
    `busy_until_done` records that, and `is_busy` tells the environment pool not to hand the
    instance to another rollout while the call can still change it. Its own rollout must not
    trust the instance either: while `watch`ed (an episode's environment), the names of such
    calls are kept for `unwatch`, and `late_call_running` tells the tool loop to refuse its
    next tool calls while one still runs."""

    def __init__(self, size: int, setting: str, thread_name_prefix: str = "") -> None:
        """`setting`: the config field that sized the pool, for the error message."""
        super().__init__(size, thread_name_prefix=thread_name_prefix)
        self.size, self.setting = size, setting
        self._held: Counter[str] = Counter()
        self._cancelled: Counter[str] = Counter()  # of those, the calls cancelled with a rollout
        self._timeout_s: float | None = None  # tool_timeout_s, for the message
        self._busy: dict[int, list] = {}  # id(owner) -> [owner, calls still running on it]
        self._watched: dict[int, list] = {}  # id(owner) -> [owner, names of its late calls]
        self._lock = threading.Lock()

    def held(self) -> dict[str, int]:
        """Threads held by timed-out or cancelled calls, by tool (or environment method) name."""
        with self._lock:
            return +self._held

    def hold(self, tool: str, call: Future, timeout_s: float | None, *,
             cancelled: bool = False) -> None:
        """Count `call`'s thread until the call returns: a call of `tool` past `timeout_s`
        (raises once held calls hold more than half the threads), or, `cancelled`, one whose
        rollout was cancelled mid-call (counts only)."""
        with self._lock:
            if call.done():  # returned meanwhile, or cancelled before it started
                return
            self._held[tool] += 1
            self._cancelled[tool] += cancelled
            if timeout_s is not None:
                self._timeout_s = timeout_s
        call.add_done_callback(lambda _: self._release(tool, cancelled))
        if not cancelled:
            self.check_held()

    def check_held(self) -> None:
        """Raise `ToolThreadsHeldError` when held calls hold more than half the threads."""
        with self._lock:
            held, cancelled = +self._held, +self._cancelled
        if sum(held.values()) * 2 > self.size:
            raise ToolThreadsHeldError(self._held_message(held, cancelled))

    def _release(self, tool: str, cancelled: bool) -> None:
        with self._lock:
            self._held[tool] -= 1
            self._cancelled[tool] -= cancelled

    def busy_until_done(self, owner: object, call: Future, name: str | None = None) -> None:
        """Mark `owner` (a bound tool's `__self__`) busy until `call`, which its caller stopped
        waiting for (timed out or cancelled), returns; None or a finished call marks nothing.
        A watched owner records `name` either way (a call that returned just now wrote too)."""
        if owner is None:
            return
        with self._lock:
            watched = self._watched.get(id(owner))
            if watched is not None and name is not None:
                watched[1].append(name)
            if call.done():
                return
            self._busy.setdefault(id(owner), [owner, 0])[1] += 1  # keeps owner (and its id) alive
        call.add_done_callback(lambda _: self._unbusy(owner))

    def _unbusy(self, owner: object) -> None:
        with self._lock:
            entry = self._busy[id(owner)]
            entry[1] -= 1
            if not entry[1]:
                del self._busy[id(owner)]

    def is_busy(self, owner: object) -> bool:
        """Whether a call its caller stopped waiting for still runs on `owner`."""
        with self._lock:
            return id(owner) in self._busy

    def watch(self, owner: object) -> None:
        """Record, until `unwatch`, the calls on `owner` (an episode's environment instance)
        that their callers stop waiting for."""
        with self._lock:
            self._watched[id(owner)] = [owner, []]

    def unwatch(self, owner: object) -> list[str]:
        """Stop watching `owner`; the names of its calls recorded meanwhile."""
        with self._lock:
            entry = self._watched.pop(id(owner), None)
        return [] if entry is None else entry[1]

    def late_call_running(self, owner: object) -> str | None:
        """The name of a recorded call still running on the watched `owner`, else None."""
        with self._lock:
            watched = self._watched.get(id(owner))
            return watched[1][-1] if watched and watched[1] and id(owner) in self._busy else None

    def _held_message(self, held: dict[str, int], cancelled: dict[str, int]) -> str:
        worst = max(held, key=held.get)
        calls = ", ".join(f"{name!r} {count}" for name, count in
                          sorted(held.items(), key=lambda item: -item[1]))
        timeout = "" if self._timeout_s is None else f" (tool_timeout_s={self._timeout_s:g})"
        if cancelled.get(worst, 0) < held[worst]:
            what = f"Sync tool {worst!r} timed out{timeout} and its calls have not returned"
        else:
            what = (f"Sync call {worst!r} was cancelled with its rollout (its group stalled or "
                    "was dropped) and has not returned")
        kind = "timed-out or cancelled calls" if cancelled else "timed-out calls"
        return (f"{what}: {kind} ({calls}) hold {sum(held.values())} of the "
                f"{self.size} threads ({self.setting}) that tools, environments and rewards "
                "share, and a thread cannot be stopped, so rollouts would wait for a thread until "
                f"no_progress_timeout. Make {worst!r} return within tool_timeout_s (a timeout on "
                "what it waits for), or make it `async def` (a timed-out async call is cancelled "
                "and holds no thread).")
