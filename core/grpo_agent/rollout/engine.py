"""`RolloutEngine`: dispatch, the score queue, server polling, heartbeat and metric flushes.

Design decision: one asyncio event loop runs six cooperating tasks (dispatch, score, server
poll, heartbeat, metric flush, stop watch) plus one task per group and per rollout. The
dispatcher starts a group only while the token allowance has room (`rollout.allowance`) and a
rollout slot is free and the bounded score queue in front of the scorer is not full, so slow
rewards block generation (`rollout/score_block_s`) instead of piling up memory; what scoring makes of
a group (samples or the reason it has none) is `rollout.group_scoring`, the books it moves
(tokens queued, groups in flight) are kept here. A group that ends unscored (dropped, or in
flight when the run ends) logs what its rollouts observed, those cut short included
(`rollout.unfinished`), once. Blocking work (chat
templates, sync rewards, reconciliation, environment calls) runs in the loop's
`tool_executor`, never on the loop thread. A group's equal first turns go to the server as one
request with `n` (`rollout.first_turns`). The engine calls the user's hooks on the
`AsyncRolloutLoop` it drives and talks to the trainer only through `WorkerChannels`.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from grpo_agent import stall
from grpo_agent.metrics import Observation
from grpo_agent.rollout import allowance, group_failures, unfinished
from grpo_agent.rollout.channels import METRICS_FLUSHED, WorkerChannels
from grpo_agent.rollout.concurrency import (
    POLL_INTERVAL_S,
    ConcurrencyCap,
    RolloutSlots,
    RolloutThreadPool,
)
from grpo_agent.rollout.environments import EnvironmentEpisodeError
from grpo_agent.rollout.first_turns import SharedFirstTurns
from grpo_agent.rollout.group_scoring import (
    build_group,
    rollout_observations,
    score_group,
    unfinished_observations,
)
from grpo_agent.rollout.prompts import PromptSlot, iterate_prompts
from grpo_agent.rollout.scoring import RewardFailureTracker
from grpo_agent.rollout.unfinished import CallsSoFar
from grpo_agent.rollout.versions import pin_rollout_version
from grpo_agent.sampler import recovery
from grpo_agent.sampler.client import SamplerClient
from grpo_agent.sampler.errors import RequestRejectedError, SamplerError
from grpo_agent.stall import StageStalled
from grpo_agent.types import PromptConsumed, RolloutGroup, TrainingSample

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
METRICS_FLUSH_INTERVAL_S = 1.0
ALLOWANCE_POLL_S = 0.05
CHANNEL_POLL_S = 0.05  # how often the stop request is checked


class RolloutEngine:
    """Drives one `AsyncRolloutLoop` inside the worker until `channels.stop` is set."""

    def __init__(self, loop, channels: WorkerChannels) -> None:
        """`loop`: the `AsyncRolloutLoop` (or subclass) whose hooks this engine calls."""
        self.loop = loop
        self.config = loop.config
        self.channels = channels
        self.cap: ConcurrencyCap | None = None
        self.slots: RolloutSlots | None = None
        self.score_queue: asyncio.Queue[RolloutGroup] | None = None
        self._failures = RewardFailureTracker()
        self._group_failures = group_failures.GroupFailureTracker()
        self._observations: list[Observation] = []
        # group_id -> what the group observed so far, for each group dispatched whose
        # observations are not logged yet (`_log_unlogged`): read when it is dropped or the run ends
        self._unlogged: dict[int, Callable[[], list[Observation]]] = {}
        self._group_tasks: set[asyncio.Task] = set()
        self._fatal: asyncio.Future | None = None
        self._groups_in_flight = 0  # dispatched, not yet scored or dropped (the allowance's)
        self._groups_generating = 0  # of those, the ones whose rollouts run or wait for a slot
        self._groups_done = 0
        self._stalled_groups = 0
        self._group_tokens_total = 0
        self._queued_tokens = 0
        self._completed_rollouts = 0
        self._generated_tokens = 0
        self._progress_mark = (time.perf_counter(), 0, 0)
        self._restores_seen = 0  # the trainer's server restores whose facts are read

    async def run(self) -> None:
        """Connect, run the loop's `setup`, the pipeline and `close`; raise the first failure."""
        loop, config = self.loop, self.config
        sampler = SamplerClient(
            config.vllm_server_base_url, timeout=config.vllm_server_timeout,
            max_connections=config.max_concurrent_rollouts + 8)
        executor = RolloutThreadPool(config.max_concurrent_rollouts, "max_concurrent_rollouts",
                                     thread_name_prefix="rollout-tools")
        loop.stalls.context = self.stall_context
        loop.stalls.peer_pid = os.getppid()  # the trainer: its stacks go in our reports
        loop.stalls.start()
        self._beat()
        self._restores_seen = self._restores()
        try:
            await loop.connect(sampler, executor)
            self._start_scheduling()
            await loop.setup()
            try:
                await self._run_pipeline()
            finally:
                await loop.close()
        finally:
            loop.stalls.stop()
            await sampler.aclose()
            executor.shutdown(wait=False, cancel_futures=True)

    def stall_context(self) -> dict[str, Any]:
        """What a stall report of the worker records besides its stages and stacks. The groups
        dispatched and not finished are split: generating (what `max_concurrent_rollouts`
        bounds, by rollouts) and generated but awaiting their score (the one being scored, the
        queue's, and those that finished while it was full)."""
        slots = self.slots
        return {"model_version": int(self.channels.model_version.value),
                "server": self.config.vllm_server_base_url,
                "server_model": getattr(self.loop.server, "model_id", None),
                "groups_generating": self._groups_generating,
                "groups_awaiting_score": self._groups_in_flight - self._groups_generating,
                "rollouts_running": slots.in_flight if slots else None,
                "rollouts_waiting_for_slot": slots.promised if slots else None,
                "concurrency_cap": slots.cap.value if slots else None,
                "score_queue_size": self.score_queue.qsize() if self.score_queue else None,
                "completed_rollouts": self._completed_rollouts, "stalled_groups": self._stalled_groups}

    def _start_scheduling(self) -> None:
        """The concurrency cap from the probed server, the score queue, the failure future."""
        self.cap = self._cap_for(self.loop.server)
        self.slots = RolloutSlots(self.cap)
        self.score_queue = asyncio.Queue(self.loop.score_queue_maxsize)
        self._fatal = asyncio.get_running_loop().create_future()

    def _cap_for(self, facts) -> ConcurrencyCap:
        return ConcurrencyCap(self.config.max_concurrent_rollouts, facts.kv_tokens,
                              facts.max_model_len)

    async def _run_pipeline(self) -> None:
        tasks = [asyncio.create_task(coro) for coro in (
            self._dispatch(), self._score_forever(), self._poll_server(), self._heartbeat(),
            self._flush_metrics(), self._wait_for_stop(), _await_future(self._fatal))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise the first failure
        finally:
            for task in [*tasks, *self._group_tasks]:
                task.cancel()
            await asyncio.gather(*tasks, *self._group_tasks, return_exceptions=True)
            self._send_last_observations()

    # ------------------------------------------------------------------ dispatch

    def _allowance_has_room(self) -> bool:
        return allowance.has_room(
            self.channels.token_allowance.value, max_staleness=self.config.max_staleness,
            queued_tokens=self._queued_tokens, groups_in_flight=self._groups_in_flight,
            groups_done=self._groups_done, group_tokens_total=self._group_tokens_total)

    async def _wait_for_room(self) -> None:
        """Wait until a group may start: the token allowance has room, a rollout slot is free,
        the score queue is not full (a group that frees its slots must not let the next one
        start while scoring lags, or generated groups pile up behind a slow reward), and the
        server is up."""
        # rollout/backpressure_s counts every poll the token allowance was closed, also when it
        # closed while the dispatcher was already waiting for a rollout slot.
        blocked = 0.0
        while True:
            if self._restores() != self._restores_seen and not self._server_down():
                await self._reread_server()
            room = self._allowance_has_room()
            if (room and self.slots.can_dispatch() and not self.score_queue.full()
                    and not self._server_down()):
                break
            polled = time.perf_counter()
            await asyncio.sleep(ALLOWANCE_POLL_S)
            if not room:
                blocked += time.perf_counter() - polled
        self.observe("rollout/backpressure_s", blocked)

    async def _dispatch(self) -> None:
        loop = self.loop
        stream = iterate_prompts(loop.dataset, seed=self.config.seed,
                                 start_index=loop.dataset_start_index, accept=loop.filter_prompt)
        for group_id, slot in enumerate(stream):
            if not slot.accepted:
                self._put(PromptConsumed(slot.prompt_index, slot.row_index, "filtered"))
                continue
            await self._wait_for_room()
            self._groups_in_flight += 1
            self._groups_generating += 1
            self.slots.promise(self.config.num_generations)
            task = asyncio.create_task(self._run_group(slot, group_id))
            self._group_tasks.add(task)
            task.add_done_callback(self._group_finished)

    def _group_finished(self, task: asyncio.Task) -> None:
        self._group_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._fatal.done():
            self._fatal.set_exception(task.exception())

    async def _run_group(self, slot: PromptSlot, group_id: int) -> None:
        version = int(self.channels.model_version.value)
        pin_rollout_version(version)  # inherited by the rollout tasks that gather creates
        stall.set_group(group_id)  # so is this: the group's late stages are reported once
        took_slot = [0]  # rollouts that took their slot: the rest are withdrawn if the group drops
        shared = (SharedFirstTurns(self.config.num_generations)
                  if self.config.share_first_turn_request else None)
        calls = [CallsSoFar() for _ in range(self.config.num_generations)]
        rollouts = [asyncio.ensure_future(self._run_rollout(slot, group_id, took_slot, shared, record))
                    for record in calls]
        self._unlogged[group_id] = functools.partial(self._seen_by, rollouts, calls)
        try:
            results = await asyncio.gather(*rollouts)
        except asyncio.CancelledError:
            # gather ends at its first cancelled rollout; the others may still be cleaning up (a
            # command agent being reaped). Without this the worker's loop closed under them and
            # asyncio warned "Loop ... that handles pid N is closed" at the end of --agent-cmd runs.
            await _cancel_all(rollouts)
            raise
        except StageStalled:  # reported by the watch: drop the group, count it, go on
            await self._cancel_group(rollouts, took_slot, group_id)
            self._drop_stalled(slot.prompt_index, slot.row_index)
            return
        except (EnvironmentEpisodeError, RequestRejectedError) as error:
            reason = group_failures.failure_reason(error)
            if reason is None:
                raise
            await self._cancel_group(rollouts, took_slot, group_id)  # one bad row costs its group
            self._group_failures.failed(reason, error, slot.prompt_index, slot.row_index)
            self._drop_group(slot.prompt_index, slot.row_index, reason)
            return
        except SamplerError as error:
            if not await self._lost_the_server(error):
                raise
            await self._cancel_group(rollouts, took_slot, group_id)  # lost with the server: counted
            self._drop_group(slot.prompt_index, slot.row_index, "server_lost")
            return
        finally:
            self._groups_generating -= 1
            if not all(rollout.done() for rollout in rollouts):
                # an error that stops the run ended gather: its siblings would go on calling
                # tools and the server until the worker's loop closed, after its last metrics
                await _cancel_all(rollouts)
            if shared is not None:
                await shared.close()
        self._group_failures.succeeded()
        group = await build_group(self.loop, slot, group_id, version, results, self.observe,
                                  self.observe_rate)
        started = time.perf_counter()
        await self.score_queue.put(group)
        self.observe("rollout/score_block_s", time.perf_counter() - started)
        self.observe("rollout/score_queue_size", self.score_queue.qsize())

    async def _cancel_group(self, rollouts: list[asyncio.Future], took_slot: list[int],
                            group_id: int) -> None:
        """Cancel a dropped group's rollouts; those that never ran give their promise back
        (else each drop would shrink the dispatcher's room for good). What they observed is
        logged (`_seen_by`)."""
        await _cancel_all(rollouts)
        self.slots.withdraw(len(rollouts) - took_slot[0])
        self._log_unlogged(group_id)

    def _seen_by(self, rollouts: list[asyncio.Future], calls: list[CallsSoFar]) -> list[Observation]:
        """What a group's rollouts observed, whatever ends the group unscored (dropped, or the
        run's end): the own observations of those that finished, the tool calls of those that
        did not (cancelled part-way, or raising the error that dropped the group). Their calls
        and failures happened, and the spec counts every one (`tools/*`)."""
        returned = [task.done() and not task.cancelled() and task.exception() is None
                    for task in rollouts]
        finished = [task.result()[1] for task, done in zip(rollouts, returned) if done]
        cut_short = [record for record, done in zip(calls, returned) if not done]
        seen = rollout_observations(self.loop, finished) if finished else []
        return seen + unfinished_observations(self.loop, cut_short)

    def _log_unlogged(self, group_id: int) -> None:
        """Log what a group observed so far (`_unlogged`), once."""
        read = self._unlogged.pop(group_id, None)
        if read is not None:
            self._observations += read()

    async def _run_rollout(self, slot: PromptSlot, group_id: int, took_slot: list[int],
                           shared: SharedFirstTurns | None, calls: CallsSoFar) -> tuple:
        with unfinished.recording(calls):  # its tool calls count should it not return
            if shared is None:
                return await self._run_episode(slot, group_id, took_slot)
            with shared.ticket():  # its first turn may go out in one request with its siblings'
                return await self._run_episode(slot, group_id, took_slot, shared)

    async def _run_episode(self, slot: PromptSlot, group_id: int, took_slot: list[int],
                           shared: SharedFirstTurns | None = None) -> tuple:
        must_wait = shared is not None and not self.slots.has_free_slot()
        with shared.away() if must_wait else contextlib.nullcontext():
            in_flight = await self.slots.acquire()
        took_slot[0] += 1
        self.observe("rollout/concurrency", in_flight)
        started = time.perf_counter()
        try:
            prompt, rollout, env_reward = await self.loop.run_episode(slot.row, slot.row_index, group_id)
        finally:
            await self.slots.release()
        self._completed_rollouts += 1
        self._generated_tokens += sum(len(turn.output_ids) for turn in rollout.turns)
        self.observe("rollout/duration_s", time.perf_counter() - started)
        return prompt, rollout, env_reward

    # ------------------------------------------------------------------ scoring

    async def _score_forever(self) -> None:
        while True:
            group = await self.score_queue.get()
            self.observe("rollout/score_wait_s", time.monotonic() - group.queued_at)
            started = time.perf_counter()
            await self._score(group)
            self.observe("rollout/score_s", time.perf_counter() - started)

    async def _score(self, group: RolloutGroup) -> None:
        scored = await score_group(self.loop, group, self._failures)
        self._unlogged.pop(group.group_id, None)  # its observations are these
        self._observations += scored.observations
        if scored.stops_run is not None:
            raise scored.stops_run
        if scored.reason == "stalled":
            self._drop_stalled(group.prompt_index, group.row_index)
            return
        notice = (None if scored.reason is None
                  else PromptConsumed(group.prompt_index, group.row_index, scored.reason))
        self._finish_group(group, scored.samples, notice)

    def _finish_group(self, group: RolloutGroup, samples: list, notice: PromptConsumed | None) -> None:
        tokens = sum(sample.num_tokens for sample in samples)
        self._group_tokens_total += sum(
            len(seq.token_ids) for seqs in group.completions_sequences for seq in seqs)
        self._queued_tokens += tokens
        self._groups_done += 1
        self._groups_in_flight -= 1
        for sample in samples:
            self._put(sample)
        if notice is not None:
            self._put(notice)

    def _drop_stalled(self, prompt_index: int, row_index: int) -> None:
        """A group whose stage passed its deadline: consumed untrained, counted."""
        self._stalled_groups += 1
        self._drop_group(prompt_index, row_index, "stalled")

    def _drop_group(self, prompt_index: int, row_index: int, reason: str) -> None:
        """A group that ends untrained: consumed (the ledger moves past it), counted as
        `rollout/{reason}_group_count`."""
        self._groups_in_flight -= 1
        self.observe(f"rollout/{reason}_group_count", 1)
        self._put(PromptConsumed(prompt_index, row_index, reason))

    async def _lost_the_server(self, error: SamplerError) -> bool:
        """Whether `error` means the server is gone (`recovery.means_server_lost`); then ask
        the trainer to restore it (`server_down`) and dispatch nothing until it has. The log
        gives the error's one-line `reason`: its advice (start a server) is wrong while the
        trainer restores it; a run that stops instead raises the error with its advice."""
        if self.channels.server_down is None or not await recovery.means_server_lost(
                error, self.config.vllm_server_base_url):
            return False
        if not self.channels.server_down.is_set():
            logger.warning("Lost the vLLM server at %s (%s); the groups in flight are dropped "
                           "and counted, and new ones wait until the trainer restores it.",
                           self.config.vllm_server_base_url, error.reason)
            self.channels.server_down.set()
        return True

    def _server_down(self) -> bool:
        return self.channels.server_down is not None and self.channels.server_down.is_set()

    def _restores(self) -> int:
        restores = self.channels.server_restores
        return 0 if restores is None else int(restores.value)

    async def _reread_server(self) -> None:
        """The trainer restored the server (whoever noticed the loss): the loop re-reads its
        facts (`AsyncRolloutLoop.reconnect`) and the concurrency cap starts again from the new
        server's KV cache and `max_model_len`, before the next group starts. A server lost
        again meanwhile is waited for as any loss; the next restore reads it again."""
        restores = self._restores()
        try:
            before = await self.loop.reconnect()
        except SamplerError as error:
            if await self._lost_the_server(error):
                return
            raise
        self._restores_seen = restores
        facts = self.loop.server
        self.cap = self.slots.cap = self._cap_for(facts)
        await self.slots.cap_changed()
        names = [name for name in ("model_id", "max_model_len", "kv_tokens", "on_cpu",
                                   "supports_sampling_mask")
                 if getattr(before, name) != getattr(facts, name)]
        changed = [f"{name} {getattr(before, name)!r} -> {getattr(facts, name)!r}" for name in names]
        if changed:  # a GPU's KV cache may differ by a few blocks from one start to the next
            level = logging.INFO if names == ["kv_tokens"] else logging.WARNING
            logger.log(level, "The restored vLLM server at %s differs from the one before: %s. "
                           "The rollouts follow it (seeds %s, sampling masks %s, concurrency "
                           "cap %d).", self.config.vllm_server_base_url, ", ".join(changed),
                           "off: a CPU server" if facts.on_cpu else "on",
                           "asked for" if self.loop.sampling_params.return_sampling_mask
                           else "not asked for", self.cap.value)

    def _put(self, item: TrainingSample | PromptConsumed) -> None:
        self.channels.samples.put(item)

    # ------------------------------------------------------------------ background tasks

    async def _poll_server(self) -> None:
        """Every 5 s: adjust the concurrency cap and record the server's load gauges. The first
        read comes one interval after the start: one at the start came before the first request
        and put an idle server's zeros into every run's first window (the starting cap, read
        off the server's facts, is recorded at once)."""
        sampler = self.loop.sampler
        last_preemptions, failing = None, False
        self.observe("rollout/concurrency_cap", self.cap.value)
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                metrics = await sampler.metrics()
                failing = False
            except SamplerError as error:
                if not failing:  # once per outage: a server restart took 158 s, 14 lines
                    logger.warning("Polling %s/metrics failed: %s (said once until it answers "
                                   "again; the concurrency cap stays at %d meanwhile)",
                                   sampler.base_url, error, self.cap.value)
                failing, metrics = True, None
            self.cap.update(metrics, self._completed_rollouts)
            await self.slots.cap_changed()
            self.observe("rollout/concurrency_cap", self.cap.value)
            if metrics is not None:
                if metrics.kv_cache_usage is not None:  # unknown is no 0 in the mean
                    self.observe("rollout/vllm_kv_cache_usage_frac", metrics.kv_cache_usage)
                self.observe("rollout/vllm_running_requests", metrics.running)
                self.observe("rollout/vllm_queued_requests", metrics.waiting)
                if last_preemptions is not None:
                    self.observe("rollout/vllm_preemption_count", metrics.preemptions - last_preemptions)
                last_preemptions = metrics.preemptions

    def _beat(self) -> None:
        self.channels.heartbeat.value = time.time()

    async def _heartbeat(self) -> None:
        while True:
            self._beat()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _wait_for_stop(self) -> None:
        while not self.channels.stop.is_set():
            await asyncio.sleep(CHANNEL_POLL_S)

    async def _flush_metrics(self) -> None:
        """Send observations once a flush interval (and all of them as the worker stops)."""
        while True:
            await asyncio.sleep(METRICS_FLUSH_INTERVAL_S)
            self._send_observations()

    def _send_last_observations(self) -> None:
        """As the worker stops: what the groups still in flight (generating, queued or being
        scored) observed so far, the rest not sent yet, then `METRICS_FLUSHED`, which the run's
        last step waits for (`RolloutWorker.finish`): it logs them in its own row."""
        for group_id in list(self._unlogged):
            self._log_unlogged(group_id)
        self._send_observations()
        self.channels.metrics.put(METRICS_FLUSHED)

    def _record_progress(self) -> None:
        """Throughput and retries since the last flush."""
        now = time.perf_counter()
        retries = self.loop.sampler.retry_count
        last_time, last_retries, last_tokens = self._progress_mark
        self.observe_rate("rollout/generated_tokens_per_s", self._generated_tokens - last_tokens,
                          now - last_time)
        self.observe("rollout/vllm_retry_count", retries - last_retries)
        self._progress_mark = (now, retries, self._generated_tokens)

    def observe(self, name: str, value: float) -> None:
        self._observations.append((name, float(value)))

    def observe_rate(self, name: str, amount: float, seconds: float) -> None:
        self._observations.append((name, (float(amount), float(seconds))))

    def _send_observations(self) -> None:
        self._record_progress()
        if self._observations:
            batch, self._observations = self._observations, []
            self.channels.metrics.put(batch)


async def _await_future(future: asyncio.Future) -> None:
    await future


async def _cancel_all(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
