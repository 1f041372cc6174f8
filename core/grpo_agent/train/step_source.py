"""The trainer's side of the sample queue: one optimizer step's samples at a time.

A step is filled by tokens, not by a sample count (the spec: kept groups fill the step, so
the more groups are dropped, the more generation a step needs). We block until the step planner
says the step's rows are full; the sample that did not fit is carried to the next step, never
dropped. Only the run's last step may be partial. Prompt notices update the ledger
here, and samples of prompts trained before a resume are discarded here.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from grpo_agent import stall
from grpo_agent.metrics import MetricWindow
from grpo_agent.rollout.loop import METRICS_FLUSH_INTERVAL_S
from grpo_agent.train.batching import StepPlanner
from grpo_agent.types import PromptConsumed, TrainingSample

if TYPE_CHECKING:
    from grpo_agent.train.trainer import AsyncGRPOTrainer

PULL_POLL_S = 1.0
STARVED_WARNING_S = 60.0

logger = logging.getLogger(__name__)


class StepSource:
    """Wraps the rollout worker (rank 0 only)."""

    def __init__(self, worker: Any, trainer: AsyncGRPOTrainer) -> None:
        self.worker = worker
        self.trainer = trainer
        self._carry: list[TrainingSample] = []
        self.no_progress = stall.NoProgressGuard(trainer.args.no_progress_timeout, stall.active())

    @classmethod
    def start(cls, trainer: AsyncGRPOTrainer, model_name: str, start_index: int) -> StepSource:
        from grpo_agent.rollout.worker import RolloutWorker

        worker = RolloutWorker(
            trainer.loop_cls,
            config=trainer.args,
            model_name=model_name,
            dataset=trainer.train_dataset,
            reward_funcs=trainer.reward_funcs,
            processing_class=trainer.processing_class,
            tools=trainer.tools,
            environment_factory=trainer.environment_factory,
            dataset_start_index=start_index,
            lora_name=trainer.pusher.lora_name,  # the adapter name prefix under LoRA sync
        )
        worker.set_model_version(trainer.model_version)
        worker.start()
        return cls(worker, trainer)

    def next_step(self, planner: StepPlanner) -> list[TrainingSample]:
        """Fill `planner` with one step: block until its rows are full (the spec: kept groups
        fill the step) or every prompt of the run was consumed, whichever comes first.

        Returns no samples only when the run's prompt epochs were all consumed without a sample
        (every group dropped), so a run on a task its model never scores still ends.
        """
        taken: list[TrainingSample] = []
        pending, self._carry = self._carry, []
        waited = 0.0
        last_progress = time.perf_counter()
        self._last_starved_warning = 0.0
        with stall.stage("queue_pull", step_samples=len(taken)) as pull_stage:
            while True:
                if not pending:
                    if self.trainer.prompt_epochs_done(taken):
                        break  # the run's last, partial step (or an empty one)
                    started = time.perf_counter()
                    items = self.worker.pull(timeout=PULL_POLL_S)
                    waited += time.perf_counter() - started
                    if items and pull_stage is not None:
                        pull_stage.touch()  # the deadline bounds the wait for the *next* item
                    pending = self._accept(items)
                    if pending:
                        last_progress, self._last_starved_warning = time.perf_counter(), 0.0
                    self._warn_if_starved(time.perf_counter() - last_progress, len(taken))
                    self.no_progress.check()
                    stall.raise_if_stalled(pull_stage)
                    continue
                sample = pending.pop(0)
                if not planner.add(sample):
                    self._carry = [sample, *pending]
                    break
                taken.append(sample)
        self._record_pull_metrics(waited)
        return taken

    def _warn_if_starved(self, idle: float, num_taken: int) -> None:
        """Say why training stalls when groups keep being dropped (nothing else would)."""
        if idle - self._last_starved_warning < STARVED_WARNING_S:
            return
        self._last_starved_warning = idle
        logger.warning(
            "No trainable sample for %.0f s (this step holds %d). If frac_reward_zero_std is "
            "near 1, every group gets equal rewards (all solved or all failed): check the reward "
            "functions, or use easier or harder prompts (see 'Saturation' in docs/quickstart.md).",
            idle, num_taken,
        )

    def _record_pull_metrics(self, waited: float) -> None:
        # Staleness, time in queue and queue size are recorded once, by RolloutWorker.pull.
        self.trainer.window.add("perf/rollout_wait_s", waited)

    def _accept(self, items: list[TrainingSample | PromptConsumed]) -> list[TrainingSample]:
        ledger = self.trainer.ledger
        fresh = []
        for item in items:
            if isinstance(item, PromptConsumed):
                ledger.record_consumed(item)
                self.no_progress.record(item.reason)
            elif not ledger.already_consumed(item.prompt_index):
                fresh.append(item)
                self.no_progress.record(None)
        return fresh

    def set_model_version(self, version: int) -> None:
        self.worker.set_model_version(version)

    def hold_admission(self) -> None:
        self.worker.hold_admission()

    def finish_step(self, samples: list[TrainingSample], window: MetricWindow) -> None:
        """Tell the worker how many tokens a step uses (its staleness allowance); take its metrics."""
        self.worker.report_step_tokens(sum(s.num_tokens for s in samples))
        if self.trainer.prompt_epochs_done():
            # The worker sends its observations once a flush interval, its notices at once: wait
            # for the last flush, or a run whose last groups were all dropped logs no reward.
            time.sleep(2 * METRICS_FLUSH_INTERVAL_S)
        window.extend(self.worker.drain_metrics())

    def stop(self) -> None:
        self.worker.stop()
