"""The trainer's side of the sample queue: one optimizer step's samples at a time.

A step is filled by tokens, not by a sample count (the spec: kept groups fill the step, so
the more groups are dropped, the more generation a step needs). We block until the step planner
says the step's rows are full; the sample that did not fit is carried to the next step, and
dropped there only if the step's push made it too stale (the staleness rule, rechecked). Only the run's last step may be partial. Prompt notices update the ledger
here, and samples of prompts trained before a resume are discarded here.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_agent import stall
from grpo_agent.metrics import MetricWindow
from grpo_agent.train.batching import StepPlanner, trained_only
from grpo_agent.train.checkpoint import PromptLedger, RolloutState
from grpo_agent.train.no_progress import NoProgressGuard
from grpo_agent.types import PromptConsumed, TrainingSample

PULL_POLL_S = 1.0
STARVED_WARNING_S = 60.0
# The run's last step waits this long at most for the stopping worker's last metrics.
LAST_FLUSH_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


def is_last_step(max_steps: int, global_step: int, epochs_done: bool) -> bool:
    """Whether the step that just ended is the run's last: `max_steps` reached (HF counts the
    step before `on_step_end`), or the prompt epochs are done. The last step stops the
    worker and takes its last metrics first, so a run that ends by max_steps logs its last
    rewards too."""
    return epochs_done or 0 < max_steps <= global_step


def ends_the_run(checkpoint: str | Path, max_steps: int, prompt_limit: int | None) -> bool:
    """Whether `checkpoint` holds its run's last step: `max_steps` reached, or every prompt
    below `prompt_limit` (the run's epochs) trained. A resume from it has nothing to train:
    `AsyncGRPOTrainer.train` only loads it and `grpo-agent train` starts no server, so an
    interrupted final save is redone in seconds (before, the resume started a server, pushed
    the weights and spawned a rollout worker; an epoch-bounded run trained one more, empty step)."""
    from transformers.trainer import TRAINER_STATE_NAME

    step = json.loads((Path(checkpoint) / TRAINER_STATE_NAME).read_text())["global_step"]
    frontier = RolloutState.load(checkpoint).first_untrained_prompt_index
    return is_last_step(max_steps, step, prompt_limit is not None and frontier >= prompt_limit)


class StepSource:
    """Fills optimizer steps from the rollout worker's sample queue (rank 0 only).

    `ledger` takes the prompt notices, `epochs_done(in_hand)` says whether the run's prompts
    are all consumed counting the samples in hand, `window` takes the worker's metrics.
    Samples and notices of prompts at or past `prompt_limit` (the end of the run's last epoch;
    the worker runs ahead of it) are ignored: the last step would train past the epochs, and the
    worker's drops there moved the ledger past the run's prompts (a 1-epoch run of 4 prompts
    logged epoch 2.0 and recorded a resume point in an epoch it never trained).
    """

    def __init__(self, worker: Any, *, ledger: PromptLedger,
                 epochs_done: Callable[[list[TrainingSample]], bool], window: MetricWindow,
                 no_progress_timeout: float, temperature: float | None = None,
                 prompt_limit: int | None = None,
                 restore_server: Callable[[], None] | None = None,
                 trained_version: Callable[[], int] | None = None) -> None:
        """`restore_server` brings the vLLM server back when the worker lost it.
        `trained_version()`: the model version that trains the step being filled (the
        trainer's); None: the worker's served one. A step planned ahead is pulled while the
        last push may still be in flight, the server (and the worker) a version behind: against
        the served version its samples counted one version fresher than trained, so
        `sample/staleness_*` said 0 where the log-probs differed as at 1, and the drop rule
        kept samples one past max_staleness."""
        self.worker = worker
        self.trained_version = trained_version
        self._staleness: list[tuple[str, float]] = []  # the taken samples', until finish_step
        self.restore_server = restore_server
        self.ledger = ledger
        self.epochs_done = epochs_done
        self.prompt_limit = prompt_limit
        self.window = window
        self._carry: list[TrainingSample] = []
        self._last_starved_warning = 0.0
        self.no_progress = NoProgressGuard(no_progress_timeout, stall.active(), temperature)

    def next_step(self, planner: StepPlanner) -> tuple[list[TrainingSample], float]:
        """Fill `planner` with one step: block until its rows are full (the spec: kept groups
        fill the step) or every prompt of the run was consumed, whichever comes first.
        Returns the samples and the seconds spent waiting for the worker.

        Returns no samples only when the run's prompt epochs were all consumed without a sample
        (every group dropped), so a run on a task its model never scores still ends.
        """
        taken: list[TrainingSample] = []
        version = self.trained_version() if self.trained_version is not None else None
        at = {} if version is None else {"version": version}
        # The carry passed the staleness rule at its pull, a push ago: it passes it again.
        budget = planner.token_budget
        pending = self._accept(self.worker.recheck_carry(self._carry, **at), budget) if self._carry else []
        self._carry = []
        waited = 0.0
        last_progress = time.perf_counter()
        self._last_starved_warning = 0.0
        with stall.stage("queue_pull", step_samples=len(taken)) as pull_stage:
            while True:
                if not pending:
                    if self.epochs_done(taken):
                        break  # the run's last, partial step (or an empty one)
                    if self.restore_server is not None and getattr(self.worker, "server_down", False):
                        self._restore(pull_stage)
                    started = time.perf_counter()
                    items = self.worker.pull(timeout=PULL_POLL_S, **at)
                    waited += time.perf_counter() - started
                    if items and pull_stage is not None:
                        pull_stage.touch()  # the deadline bounds the wait for the *next* item
                    pending = self._accept(items, budget)
                    if any(sample.num_tokens <= budget for sample in pending):
                        last_progress, self._last_starved_warning = time.perf_counter(), 0.0
                    trains = len(taken) - len(planner.dropped)  # the oversize are taken too
                    self._warn_if_starved(time.perf_counter() - last_progress, trains)
                    self.no_progress.check()
                    stall.raise_if_stalled(pull_stage)
                    continue
                sample = pending.pop(0)
                if not planner.add(sample):
                    self._carry = [sample, *pending]
                    break
                taken.append(sample)
        # Time in queue and queue size are recorded by the worker's pull; staleness here, against
        # the version that trains the step (a carried sample is trained a push after its pull),
        # of the samples it trains (an oversize one is dropped).
        if version is None:
            version = getattr(self.worker, "model_version", None)
        if version is not None:
            for sample in trained_only(taken, planner.dropped):
                staleness = float(version - sample.model_version)
                self._staleness += [("sample/staleness_mean", staleness),
                                    ("sample/staleness_max", staleness)]
        return taken, waited

    def _restore(self, pull_stage: Any) -> None:
        """Bring the server back on the restore's deadline (a managed restart may take its
        startup timeout), not the queue pull's, which waits meanwhile."""
        waiting = pull_stage.set_aside() if pull_stage is not None else contextlib.nullcontext()
        with waiting, stall.stage("server_restore"):
            self.restore_server()  # bounded: a restart or vllm_server_timeout

    def _warn_if_starved(self, idle: float, num_trained: int) -> None:
        """Say why training stalls when groups keep being dropped (nothing else would);
        `num_trained`: the samples this step holds that it will train."""
        if idle - self._last_starved_warning < STARVED_WARNING_S:
            return
        self._last_starved_warning = idle
        other = {reason for reason, n in self.no_progress.dropped.items() if n and reason != "zero_std"}
        # Failing agents, nothing scoring, failing rewards, stalls, greedy sampling: the cause
        # says which, where the advice below would send the user to the rewards and prompts.
        if other or self.no_progress.temperature == 0:
            logger.warning("No trainable sample for %.0f s (this step holds %d): %s", idle, num_trained,
                           self.no_progress.cause(idle))
            return
        logger.warning(
            "No trainable sample for %.0f s (this step holds %d). If frac_reward_zero_std is "
            "near 1, every group gets equal rewards (all solved or all failed): check the reward "
            "functions, or use easier or harder prompts (see 'Saturation' in docs/quickstart.md).",
            idle, num_trained,
        )

    def _accept(self, items: list[TrainingSample | PromptConsumed], budget: int) -> list[TrainingSample]:
        """The fresh samples among `items`. One longer than `budget` goes on to the planner,
        which drops it, but is no progress: a run whose every sample is oversize never trains."""
        ledger = self.ledger
        fresh = []
        for item in items:
            if self.prompt_limit is not None and item.prompt_index >= self.prompt_limit:
                continue  # past the run's epochs
            if isinstance(item, PromptConsumed):
                ledger.record_consumed(item)
                self.no_progress.record(item.reason)
            elif not ledger.already_consumed(item.prompt_index):
                fresh.append(item)
                self.no_progress.record("oversize_sample" if item.num_tokens > budget else None,
                                        group=item.group_id)
        return fresh

    def finish_step(self, samples: list[TrainingSample], *, last: bool) -> None:
        """Tell the worker how many tokens a step uses (its staleness allowance: the step's
        oversize drops count, the worker generated them for this step); take its
        metrics. On the run's `last` step, first stop it (`finish`) for the ones not sent yet:
        notices come at once, observations once a second (a run whose last groups were all
        dropped would log no reward), and the groups still in flight send what they observed
        (tool calls and failures) only as it stops, which no row after the last step logs."""
        self.worker.report_step_tokens(sum(s.num_tokens for s in samples))
        if last and not self.worker.finish(LAST_FLUSH_TIMEOUT_S):
            logger.warning("The rollout worker did not send its last metrics within %.0f s; the "
                           "last step's rollout metrics may be incomplete.", LAST_FLUSH_TIMEOUT_S)
        observations, self._staleness = self._staleness, []
        self.window.extend(observations + self.worker.drain_metrics())
