"""One sampler request per group for the first turns its rollouts share.

Why: a GRPO group's rollouts start from one prompt, so their first turns are the same request
`num_generations` times. One request with vLLM's `n` lets the server share the prompt and
costs the API server and this worker one HTTP exchange instead of `n` (`bench/group_requests.py`:
1.3-1.9x the generated tokens/s, 0.27-0.36x the client CPU per token). Later turns (after tool
results) differ per rollout and go one by one.

How: the engine makes one `SharedFirstTurns` per group, which counts the group's rollouts from
the start, and gives each rollout a ticket (a context variable). A rollout's first
`generate_one_turn` hands its request to the group instead of sending it. The group sends once
every rollout has asked, ended, or is away waiting for a rollout slot (siblings render their
prompts in the executor, so they arrive apart), or `WAIT_S` after the first waiting ask,
whichever comes first: a rollout that waits on something else before it asks (a resource a
sibling holds) delays its siblings, never blocks them. Asks with equal prompt ids, sampling
settings and model go out as one request; any other ask goes out alone, so nothing is sampled
that no rollout asked for.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator

from grpo_agent.sampler.client import SamplingParams
from grpo_agent.types import TurnRecord

WAIT_S = 2.0

# send(prompt_ids, params, model, n) -> n records (the loop's request, adapter fallback included)
Send = Callable[[list[int], SamplingParams, "str | None", int], Awaitable[list[TurnRecord]]]


class _Ticket:
    __slots__ = ("group", "used")

    def __init__(self, group: SharedFirstTurns) -> None:
        self.group, self.used = group, False


_TICKET: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("first_turn_ticket",
                                                                        default=None)


def claim() -> SharedFirstTurns | None:
    """The current rollout's group when this is its first request, else None (a later turn, a
    call outside a group rollout such as the agent gateway's, or sharing off). Call it right
    before `SharedFirstTurns.sample`: it counts the rollout as asking."""
    ticket = _TICKET.get()
    if ticket is None or ticket.used:
        return None
    ticket.used = True
    ticket.group._unasked -= 1
    return ticket.group


class _Batch:
    __slots__ = ("futures", "model", "params", "prompt_ids", "send")

    def __init__(self, prompt_ids, params, model, send) -> None:
        self.prompt_ids, self.params, self.model, self.send = prompt_ids, params, model, send
        self.futures: list[asyncio.Future] = []

    def takes(self, prompt_ids, params, model) -> bool:
        return self.prompt_ids == prompt_ids and self.params == params and self.model == model


class SharedFirstTurns:
    """The first turns of one group's rollouts (see the module docstring)."""

    def __init__(self, rollouts: int) -> None:
        self._unasked = rollouts  # rollouts that have neither asked nor ended nor are away
        self._waiting: list[_Batch] = []
        self._timer: asyncio.TimerHandle | None = None
        self._requests: set[asyncio.Task] = set()
        self.requests_sent: list[int] = []  # n of each request sent (for tests and metrics)

    @contextlib.contextmanager
    def ticket(self) -> Iterator[None]:
        """Bracket one of the group's rollouts, from its start to its end."""
        ticket = _Ticket(self)
        token = _TICKET.set(ticket)
        try:
            yield
        finally:
            _TICKET.reset(token)
            if not ticket.used:  # ended (or failed) before its first request
                ticket.used = True
                self._unasked -= 1
                self._send_if_all_asked()

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """Bracket a rollout's wait for what its asking siblings may hold (a rollout slot): the
        group does not wait for it meanwhile."""
        self._unasked -= 1
        self._send_if_all_asked()
        try:
            yield
        finally:
            self._unasked += 1

    async def sample(self, prompt_ids: list[int], params: SamplingParams, model: str | None,
                     send: Send) -> TurnRecord:
        """This rollout's first turn, sampled in one request with its siblings' equal asks."""
        batch = next((b for b in self._waiting if b.takes(prompt_ids, params, model)), None)
        if batch is None:
            batch = _Batch(list(prompt_ids), params, model, send)
            self._waiting.append(batch)
        future = asyncio.get_running_loop().create_future()
        batch.futures.append(future)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(WAIT_S, self._send_waiting)
        self._send_if_all_asked()
        return await future

    async def close(self) -> None:
        """Cancel what is still in flight (the group ended or was dropped)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for batch in self._waiting:
            for future in batch.futures:
                future.cancel()
        self._waiting = []
        for task in self._requests:
            task.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)

    def _send_if_all_asked(self) -> None:
        if self._unasked == 0 and self._waiting:
            self._send_waiting()

    def _send_waiting(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batches, self._waiting = self._waiting, []
        for batch in batches:
            live = [future for future in batch.futures if not future.done()]
            if not live:  # every asker was cancelled meanwhile
                continue
            batch.futures = live
            self.requests_sent.append(len(live))
            task = asyncio.get_running_loop().create_task(self._request(batch))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    @staticmethod
    async def _request(batch: _Batch) -> None:
        try:
            turns = await batch.send(batch.prompt_ids, batch.params, batch.model, len(batch.futures))
        except asyncio.CancelledError:
            for future in batch.futures:
                future.cancel()
            raise
        except Exception as error:  # noqa: BLE001  (every asker sees the request's failure)
            for future in batch.futures:
                if not future.done():
                    future.set_exception(error)
                    # Mark it retrieved (an asker cancelled with its group logs nothing); in a
                    # callback, so nothing here can keep the other askers from their answer.
                    future.add_done_callback(_mark_retrieved)
            return
        for future, turn in zip(batch.futures, turns):
            if not future.done():
                future.set_result(turn)


def _mark_retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
