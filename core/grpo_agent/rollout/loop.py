"""`AsyncRolloutLoop`: generates, scores and queues rollouts inside the rollout worker.

Design decision: one asyncio event loop runs five cooperating tasks (dispatch, score,
server poll, heartbeat, metric flush) plus one task per group and per rollout. The
dispatcher starts a group only while the token allowance has room and a rollout slot is free;
groups go through a bounded score queue to a scorer, so slow rewards block generation
(`rollout/score_block_s`) instead of piling up memory. Blocking work (chat templates, sync
rewards, reconciliation, environment calls) runs in `tool_executor`, never on the loop thread.
Users change behaviour through the spec's hooks; everything else is private.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from grpo_agent.metrics import Observation
from grpo_agent.rollout import observations
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.rollout.concurrency import POLL_INTERVAL_S, ConcurrencyCap, RolloutSlots
from grpo_agent.rollout.images import strip_images
from grpo_agent.rollout.plugins import (
    check_plugin_args,
    resolve_advantage_estimator,
    resolve_prompt_filters,
)
from grpo_agent.rollout.prompts import PromptSlot, iterate_prompts
from grpo_agent.rollout.sampling import build_sampling_params
from grpo_agent.rollout.scoring import (
    RewardFailureTracker,
    add_rollout_sources,
    has_signal,
    reward_name,
    run_reward_functions,
)
from grpo_agent.sampler.client import SamplerClient, adapter_name
from grpo_agent.sampler.errors import RequestRejectedError, SamplerError
from grpo_agent.sampler.server_facts import ServerFacts, probe_server
from grpo_agent.stall import StageStalled, StallWatch
from grpo_agent.types import PromptConsumed, Rollout, RolloutGroup, TrainingSample, TurnRecord

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
METRICS_FLUSH_INTERVAL_S = 1.0
ALLOWANCE_POLL_S = 0.05
ALLOWANCE_HELD = -1.0  # token_allowance value: start no group (worker.hold_admission)
# The model version a rollout samples with: its group's, set before the group's rollouts start.
_ROLLOUT_VERSION: contextvars.ContextVar[int] = contextvars.ContextVar("rollout_version")


class AsyncRolloutLoop:
    """Generates and scores rollouts for `AsyncGRPOTrainer` in the spawned rollout worker.

    Override `filter_prompt`, `generate_one`, `generate_one_turn`, `compute_advantages`,
    `setup` or `close` in a module-level subclass and set it as the trainer's `loop_cls`.
    `token_allowance` is cumulative: the forwarded tokens the trainer has pulled so far plus
    `max(max_staleness, 1)` steps' worth; a group starts only while the tokens queued and in
    flight stay below it. `lora_name`, when the trainer syncs LoRA adapters, is the adapter name
    prefix: every rollout samples with the adapter of the model version its group started
    under (`adapter_name`), so a rollout begun under an old policy finishes under it.
    """

    reports_tools = False  # True: log `tools/*` even without `tools` (the harness gateway)

    def __init__(self, config, model_name, dataset, reward_funcs, processing_class, eos_token_ids,
                 rollout_buffer, model_version_value, token_allowance, heartbeat_value,
                 failed_event, exception_info_queue, metrics_queue, tools=None,
                 environment_factory=None, score_queue_maxsize=16, lora_name=None,
                 dataset_start_index=0):
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = _named_reward_funcs(reward_funcs)
        self.tokenizer = processing_class
        self.eos_token_ids = list(eos_token_ids)
        self.rollout_buffer = rollout_buffer
        self.model_version_value = model_version_value
        self.token_allowance = token_allowance
        self.heartbeat_value = heartbeat_value
        self.failed_event = failed_event
        self.exception_info_queue = exception_info_queue
        self.metrics_queue = metrics_queue
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.dataset_start_index = dataset_start_index
        self.stop_event = None  # a multiprocessing.Event set by RolloutWorker.stop()
        # Stage deadlines; monitored once `run` starts it (evaluation only tracks stages).
        self.stalls = StallWatch(config, "worker", context=self._stall_context)
        plugin_args = getattr(config, "plugin_args", None)
        check_plugin_args(config)
        self._advantage_estimator = resolve_advantage_estimator(config.advantage_estimator, plugin_args)
        self._prompt_filters = resolve_prompt_filters(config.prompt_filters, plugin_args)

    # ------------------------------------------------------------------ hooks

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """True to roll out this prompt; by default every configured prompt filter must agree."""
        return all(accept(row_index, row, epoch) for accept in self._prompt_filters)

    async def generate_one(self, prompt: list[dict], tools: list[Callable], group_id: int = 0) -> Rollout:
        """One rollout: the multi-turn tool loop (rendering, sampling, tool calls)."""
        return await run_tool_loop(self, prompt, tools, group_id)

    async def generate_one_turn(self, prompt_ids: list[int], max_tokens: int | None = None) -> TurnRecord:
        """One vLLM request with the config's sampling settings, on the rollout's policy.

        `max_tokens` lowers `max_completion_length` for this call (the gateway's max_tokens)."""
        params = self._sampling_params
        if max_tokens is not None:
            params = replace(params, max_tokens=max_tokens)
        if self._seeds is not None:
            params = replace(params, seed=next(self._seeds))
        version = _ROLLOUT_VERSION.get(None)
        if version is None:  # called outside a rollout (e.g. from setup): the newest policy
            version = int(self.model_version_value.value)
        model = adapter_name(self.lora_name, version)
        try:
            with self.stalls.stage("vllm_generate", recover=True, prompt_tokens=len(prompt_ids)):
                return await self.sampler.generate(prompt_ids, params, model=model)
        except RequestRejectedError as error:
            newest = adapter_name(self.lora_name, int(self.model_version_value.value))
            if model is None or error.status_code != 404 or newest == model:
                raise
        # The trainer unloaded this rollout's adapter: it is more than max_staleness versions
        # old, so its samples are dropped as stale anyway. Finish it on the newest policy.
        logger.debug("Adapter %s was unloaded mid-rollout; continuing on %s.", model, newest)
        with self.stalls.stage("vllm_generate", recover=True, prompt_tokens=len(prompt_ids)):
            return await self.sampler.generate(prompt_ids, params, model=newest)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout from `group.rewards` (group-normalised by default)."""
        return self._advantage_estimator(group)

    async def setup(self) -> None:
        """Create resources the other hooks need; runs on the loop before the first prompt."""

    async def close(self) -> None:
        """Release what `setup` created; runs when the loop stops, failures included."""

    # ------------------------------------------------------------------ entry point

    def run(self) -> None:
        """Run until `stop_event` is set or something fails (then raise)."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.tool_executor = ThreadPoolExecutor(
            self.config.max_concurrent_rollouts, thread_name_prefix="rollout-tools")
        self.sampler = SamplerClient(
            self.config.vllm_server_base_url, timeout=self.config.vllm_server_timeout,
            max_connections=self.config.max_concurrent_rollouts + 8)
        self.stalls.peer_pid = os.getppid()  # the trainer: its stacks go in our reports
        self.stalls.start()
        self._beat()
        try:
            await self._connect()
            await self.setup()
            try:
                await self._run_pipeline()
            finally:
                await self.close()
        finally:
            self.stalls.stop()
            await self.sampler.aclose()
            self.tool_executor.shutdown(wait=False, cancel_futures=True)

    def _stall_context(self) -> dict[str, Any]:
        """What a stall report of the worker records besides its stages and stacks."""
        return {"model_version": int(self.model_version_value.value),
                "server": self.config.vllm_server_base_url,
                "server_model": getattr(getattr(self, "server", None), "model_id", None),
                "groups_in_flight": self._groups_in_flight,
                "score_queue_size": self.score_queue.qsize(),
                "completed_rollouts": self._completed_rollouts, "stalled_groups": self._stalled_groups}

    async def _connect(self) -> None:
        facts: ServerFacts = await probe_server(self.sampler)
        self.server = facts
        self._sampling_params = build_sampling_params(self.config, self.eos_token_ids, facts)
        self._seeds = None if facts.on_cpu else itertools.count(self.config.seed * 1_000_003)
        self.cap = ConcurrencyCap(self.config.max_concurrent_rollouts, facts.kv_tokens,
                                  facts.max_model_len)
        self.slots = RolloutSlots(self.cap)
        self.score_queue: asyncio.Queue[RolloutGroup] = asyncio.Queue(self.score_queue_maxsize)
        self._env_runner = _environment_runner(self.environment_factory, self.tool_executor)
        self._failures = RewardFailureTracker()
        self._observations: list[Observation] = []
        self._group_tasks: set[asyncio.Task] = set()
        self._fatal: asyncio.Future = asyncio.get_running_loop().create_future()
        self._groups_in_flight = 0
        self._groups_done = 0
        self._stalled_groups = 0
        self._group_tokens_total = 0
        self._queued_tokens = 0
        self._completed_rollouts = 0
        self._generated_tokens = 0
        self._progress_mark = (time.perf_counter(), 0, 0)
        self._warned_images = False

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
            self._send_observations()

    # ------------------------------------------------------------------ dispatch

    def _tokens_committed(self) -> float:
        """Tokens queued for the trainer plus the expected tokens of groups in flight."""
        per_group = self._group_tokens_total / max(self._groups_done, 1)
        return self._queued_tokens + self._groups_in_flight * per_group

    def _allowance_has_room(self) -> bool:
        allowance = self.token_allowance.value
        if allowance == ALLOWANCE_HELD:
            return False
        if self._groups_done == 0:  # no idea yet how many tokens a group makes: one at a time
            return self._groups_in_flight == 0
        if self._tokens_committed() < allowance:
            return True
        # max_staleness=0 admits one step of tokens per model version. A step can need more
        # than the last one did; with nothing in flight the trainer is still filling it (it
        # would have held admission otherwise), so one more group may start.
        return self.config.max_staleness == 0 and self._groups_in_flight == 0

    async def _wait_for_room(self) -> None:
        started = time.perf_counter()
        while not self._allowance_has_room():
            await asyncio.sleep(ALLOWANCE_POLL_S)
        self._observe("rollout/backpressure_s", time.perf_counter() - started)
        while not (self.slots.can_dispatch() and self._allowance_has_room()):
            await asyncio.sleep(ALLOWANCE_POLL_S)

    async def _dispatch(self) -> None:
        stream = iterate_prompts(self.dataset, seed=self.config.seed,
                                 start_index=self.dataset_start_index, accept=self.filter_prompt)
        for group_id, slot in enumerate(stream):
            if not slot.accepted:
                self._put(PromptConsumed(slot.prompt_index, slot.row_index, "filtered"))
                continue
            await self._wait_for_room()
            self._groups_in_flight += 1
            self.slots.promise(self.config.num_generations)
            task = asyncio.create_task(self._run_group(slot, group_id))
            self._group_tasks.add(task)
            task.add_done_callback(self._group_finished)

    def _group_finished(self, task: asyncio.Task) -> None:
        self._group_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._fatal.done():
            self._fatal.set_exception(task.exception())

    async def _run_group(self, slot: PromptSlot, group_id: int) -> None:
        version = int(self.model_version_value.value)
        _ROLLOUT_VERSION.set(version)  # inherited by the rollout tasks that gather creates
        rollouts = [asyncio.ensure_future(self._run_rollout(slot, group_id))
                    for _ in range(self.config.num_generations)]
        try:
            results = await asyncio.gather(*rollouts)
        except StageStalled:  # reported by the watch: drop the group, count it, go on
            for task in rollouts:
                task.cancel()
            await asyncio.gather(*rollouts, return_exceptions=True)
            self._drop_stalled(slot.prompt_index, slot.row_index)
            return
        group = await self._build_group(slot, group_id, version, results)
        started = time.perf_counter()
        await self.score_queue.put(group)
        self._observe("rollout/score_block_s", time.perf_counter() - started)
        self._observe("rollout/score_queue_size", self.score_queue.qsize())

    async def _run_rollout(self, slot: PromptSlot, group_id: int) -> tuple:
        in_flight = await self.slots.acquire()
        self._observe("rollout/concurrency", in_flight)
        started = time.perf_counter()
        try:
            episode = None
            if self._env_runner is not None:  # the env builds the prompt (the row may have none)
                with self.stalls.stage("env_reset", recover=True, row_index=slot.row_index):
                    episode = await self._env_runner.start(slot.row)
                prompt, tools = episode.prompt, [*self.tools, *episode.tools]
            else:
                prompt, tools = _row_prompt(slot.row), self.tools
            prompt = self._without_images(prompt, slot.row_index)
            rollout = await self.generate_one(prompt, tools, group_id)
            env_reward = None
            if episode is not None:
                with self.stalls.stage("env_finish", recover=True, row_index=slot.row_index):
                    env_reward = await self._env_runner.finish(episode)
        finally:
            await self.slots.release()
        self._completed_rollouts += 1
        self._generated_tokens += sum(len(turn.output_ids) for turn in rollout.turns)
        self._observe("rollout/duration_s", time.perf_counter() - started)
        if episode is not None:
            for name, values in episode.metrics.items():
                rollout.metrics.setdefault(name, []).extend(values)
        return prompt, rollout, env_reward

    def _without_images(self, prompt: list[dict], row_index: int) -> list[dict]:
        prompt, removed = strip_images(prompt)
        if removed and not self._warned_images:
            self._warned_images = True
            logger.warning(
                "The prompt of row %d holds %d image(s). Images are not supported yet, so they "
                "are stripped from every prompt (the model sees only the text); use a text-only "
                "dataset to silence this.", row_index, removed)
        return prompt

    async def _build_group(self, slot, group_id, version, results) -> RolloutGroup:
        prompts, rollouts, env_rewards = (list(column) for column in zip(*results))
        loop = asyncio.get_running_loop()
        reconciled = await loop.run_in_executor(
            self.tool_executor, _reconcile_all, [rollout.turns for rollout in rollouts])
        for sequences, stats in reconciled:
            self._observe("rollout/samples_per_rollout", len(sequences))
            self._observe_rate("rollout/fork_frac", stats.num_forks, stats.num_transitions)
            for drift in stats.drift_tokens:
                self._observe("rollout/drift_tokens_mean", drift)
                self._observe("rollout/drift_tokens_max", drift)
        columns = {k: v for k, v in slot.row.items() if k != "prompt"}
        size = len(rollouts)
        return RolloutGroup(
            prompts=prompts, reward_kwargs={k: [v] * size for k, v in columns.items()},
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=[sequences for sequences, _ in reconciled],
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=version, group_id=group_id, row_index=slot.row_index,
            env_rewards=env_rewards, rollout_rewards=[r.reward for r in rollouts],
            queued_at=time.monotonic(), rollouts=rollouts, prompt_index=slot.prompt_index,
        )

    # ------------------------------------------------------------------ scoring

    async def _score_forever(self) -> None:
        while True:
            group = await self.score_queue.get()
            self._observe("rollout/score_wait_s", time.monotonic() - group.queued_at)
            started = time.perf_counter()
            await self._score(group)
            self._observe("rollout/score_s", time.perf_counter() - started)

    async def _score(self, group: RolloutGroup) -> None:
        prompt_index = group.prompt_index
        try:
            with self.stalls.stage("scoring", recover=True, group_id=group.group_id,
                                   row_index=group.row_index, rewards=list(self.reward_funcs)):
                scores, failure = await run_reward_functions(self.reward_funcs, group, self.tool_executor)
        except StageStalled:  # the hung reward's thread is abandoned; the group is unscored
            self._drop_stalled(prompt_index, group.row_index)
            return
        self._failures.record(list(self.reward_funcs), failure)
        self._observations += observations.completion_observations(
            group.rollouts, with_tools=bool(self.tools or self._env_runner or self.reports_tools))
        if failure is not None:
            self._observe("rollout/reward_error_count", 1)
            self._finish_group(group, [], PromptConsumed(prompt_index, group.row_index, "reward_error"))
            return
        add_rollout_sources(scores, group)
        group.rewards = scores.total(len(group.rollouts))
        advantages = np.asarray(self.compute_advantages(group), dtype=float)
        if advantages.shape != group.rewards.shape:
            raise ValueError(
                f"compute_advantages returned shape {advantages.shape} for a group of "
                f"{len(group.rewards)} rollouts; return one advantage per rollout.")
        kept = has_signal(group.rewards)
        samples = self._samples(group, advantages, prompt_index) if kept else []
        per_rollout = [sum(s.rollout_id == r.rollout_id for s in samples) for r in group.rollouts]
        self._observations += observations.reward_observations(scores, group.rewards, per_rollout, kept)
        self._observations += observations.sample_observations(samples)
        notice = None if samples else PromptConsumed(prompt_index, group.row_index, "zero_std")
        self._finish_group(group, samples, notice)

    def _samples(self, group: RolloutGroup, advantages: np.ndarray, prompt_index: int) -> list:
        """Training samples of a kept group; unscored and zero-advantage rollouts add nothing."""
        samples = []
        for rollout, reward, advantage, sequences in zip(
                group.rollouts, group.rewards, advantages, group.completions_sequences):
            if math.isnan(reward) or advantage == 0:
                continue
            samples += [TrainingSample(
                sequence=sequence, advantage=float(advantage), model_version=group.model_version,
                group_id=group.group_id, row_index=group.row_index, prompt_index=prompt_index,
                rollout_id=rollout.rollout_id) for sequence in sequences]
        now = time.time()
        for sample in samples:
            sample.group_num_samples = len(samples)
            sample.queued_at = now
        return samples

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
        self._groups_in_flight -= 1
        self._stalled_groups += 1
        self._observe("rollout/stalled_group_count", 1)
        self._put(PromptConsumed(prompt_index, row_index, "stalled"))

    def _put(self, item: TrainingSample | PromptConsumed) -> None:
        self.rollout_buffer.put(item)

    # ------------------------------------------------------------------ background tasks

    async def _poll_server(self) -> None:
        """Every 5 s: adjust the concurrency cap and record the server's load gauges."""
        last_preemptions = None
        while True:
            try:
                metrics = await self.sampler.metrics()
            except SamplerError as error:
                logger.warning("Polling %s/metrics failed: %s", self.sampler.base_url, error)
                metrics = None
            self.cap.update(metrics, self._completed_rollouts)
            await self.slots.cap_changed()
            self._observe("rollout/concurrency_cap", self.cap.value)
            if metrics is not None:
                self._observe("rollout/vllm_kv_cache_usage_frac", metrics.kv_cache_usage)
                self._observe("rollout/vllm_running_requests", metrics.running)
                self._observe("rollout/vllm_queued_requests", metrics.waiting)
                if last_preemptions is not None:
                    self._observe("rollout/vllm_preemption_count", metrics.preemptions - last_preemptions)
                last_preemptions = metrics.preemptions
            await asyncio.sleep(POLL_INTERVAL_S)

    def _beat(self) -> None:
        self.heartbeat_value.value = time.time()

    async def _heartbeat(self) -> None:
        while True:
            self._beat()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _wait_for_stop(self) -> None:
        while self.stop_event is None or not self.stop_event.is_set():
            await asyncio.sleep(0.1)

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_INTERVAL_S)
            self._send_observations()

    def _record_progress(self) -> None:
        """Throughput and retries since the last flush."""
        now = time.perf_counter()
        last_time, last_retries, last_tokens = self._progress_mark
        self._observe_rate("rollout/generated_tokens_per_s", self._generated_tokens - last_tokens,
                           now - last_time)
        self._observe("rollout/vllm_retry_count", self.sampler.retry_count - last_retries)
        self._progress_mark = (now, self.sampler.retry_count, self._generated_tokens)

    def _observe(self, name: str, value: float) -> None:
        self._observations.append((name, float(value)))

    def _observe_rate(self, name: str, amount: float, seconds: float) -> None:
        self._observations.append((name, (float(amount), float(seconds))))

    def _send_observations(self) -> None:
        self._record_progress()
        if self._observations:
            batch, self._observations = self._observations, []
            self.metrics_queue.put(batch)


def _named_reward_funcs(reward_funcs) -> dict[str, Callable]:
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
    named: dict[str, Callable] = {}
    for func in funcs:
        name = reward_name(func)
        if name in named:
            raise ValueError(
                f"Two reward functions are both named {name!r}; metrics are logged per name "
                "(rewards/{name}/mean), so give them distinct names.")
        named[name] = func
    return named


def _row_prompt(row: dict[str, Any]) -> list[dict]:
    if "prompt" not in row:
        raise KeyError(
            "The dataset row has no 'prompt' column (it has: "
            f"{sorted(row)}). Add a conversational 'prompt' column, or pass an "
            "environment_factory whose reset() provides the prompt.")
    return row["prompt"]


def _reconcile_all(turn_lists: list[list[TurnRecord]]) -> list:
    from grpo_agent.rollout.reconcile import reconcile_turns
    return [reconcile_turns(turns) for turns in turn_lists]


def _environment_runner(factory, executor):
    if factory is None:
        return None
    from grpo_agent.rollout.environments import EnvironmentRunner
    return EnvironmentRunner(factory, executor)


async def _await_future(future: asyncio.Future) -> None:
    await future
