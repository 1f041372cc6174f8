"""`AsyncGRPOTrainer`: a `transformers.Trainer` whose batches come from a live rollout queue.

Design decision: keep `transformers.Trainer` in charge of what it already does well (optimizer,
scheduler, gradient accumulation, clipping, checkpoints with RNG state, callbacks, `report_to`,
`save_model`, `push_to_hub`) and replace only the data side. `get_batch_samples` pulls one
step's samples from the rollout worker and plans them into `gradient_accumulation_steps`
packed micro-batches; `compute_loss` is the packed row loss; `end_step` does what happens
between steps (prompt ledger, weight push, epoch accounting in prompts), called by
`AsyncStepCallback` (train/step_callback.py), which also records the step's perf metrics.
The worker starts at train begin (after a resumed checkpoint is loaded, so its position and
the pushed weights match the restored model) and always stops when `train()` returns or raises.
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import TrainOutput

from grpo_agent import stall
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.metrics import MetricWindow, Observation
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.train import collectives, fsdp, graphed_rows, heap, perf, setup
from grpo_agent.train.checkpoint import (
    PYTHON_RESUME,
    PromptLedger,
    RolloutState,
    append_ledger_line,
    resume_advice,
    resume_checkpoint,
)
from grpo_agent.train.inputs import resolve_plugins
from grpo_agent.train.loss import build_loss_config, row_loss
from grpo_agent.train.no_progress import greedy_sampling_warning
from grpo_agent.train.packing import PackedRow, pack_row
from grpo_agent.train.pipeline import RolloutPipelineMixin
from grpo_agent.train.regional_compile import compile_decoder_layers
from grpo_agent.train.row_clock import RowClock
from grpo_agent.train.sharded_checkpoint import ShardedCheckpointMixin
from grpo_agent.train.step_callback import AsyncStepCallback
from grpo_agent.train.step_rows import StepRows
from grpo_agent.train.step_source import StepSource, ends_the_run, is_last_step
from grpo_agent.train.update_guard import UpdateGuard
from grpo_agent.train.weights import remember_loaded_weights
from grpo_agent.types import TrainingSample
from grpo_agent.weight_sync.pusher import Pusher, build_weight_pusher

logger = logging.getLogger(__name__)


@dataclass
class Microbatch:
    """One process's row of one micro-batch, plus the micro-batch's trained tokens (all ranks)."""

    row: PackedRow
    num_trained_global: int


class _NoBatches:
    """The Trainer's "dataloader": batches come from the queue in `get_batch_samples`."""

    def __iter__(self):
        return iter(())


# Marks the row a stopped run logs last (`_log_unlogged_window`): the optimizer steps it covers.
STOP_WINDOW_STEPS = "stop/window_steps"
UNKNOWN_STEPS = 10**9  # the Trainer's max_steps when the prompt epochs, not max_steps, end a run


class StepProgressCallback(ProgressCallback):
    """transformers' tqdm bar, without a total when the run's length is unknown: its bar read
    `1/1000000000 [01:12<20173919:14:49]`, an ETA of 2,300 years, in the Python quick start."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None and state.max_steps >= UNKNOWN_STEPS:
            self.training_bar.total = None
            self.training_bar.unit = "step"
            self.training_bar.refresh()


class AsyncGRPOTrainer(RolloutPipelineMixin, ShardedCheckpointMixin, Trainer):
    """Asynchronous GRPO: a rollout worker generates while this trainer trains (see the spec).

    One optimizer step, in order: pull (`get_batch_samples`: the step's samples from the
    worker's queue, planned into packed rows), train (each row's forward and backward, queued
    back to back, and the optimizer step), then `end_step`: the prompt ledger, the weight push
    and version bump, the worker's allowance and metrics, the epoch count. Then the next
    step's pull (`plan_ahead`, while the GPU still runs this step), and only then the one wait
    for the GPU: the step's losses and metrics, read once, and the step's log.
    """

    loop_cls = AsyncRolloutLoop
    pusher_factory = staticmethod(build_weight_pusher)  # called at train begin (train/pipeline.py)
    # How an interrupted run's message says to resume; `grpo-agent train` sets the CLI's form.
    resume_setting = PYTHON_RESUME

    def __init__(
        self,
        model: str | nn.Module,
        reward_funcs: Callable | str | list[Callable | str] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        environment_factory: Any = None,
        eval_dataset: Any = None,
    ) -> None:
        from grpo_agent.plugins.pickling import refuse_trainer_in_spawned_import

        refuse_trainer_in_spawned_import(type(self).__name__)
        fsdp.quiet_other_ranks()  # every rank checks alike: rank 0 warns for all
        _refuse_agent_only_envs(environment_factory)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = AsyncGRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-AsyncGRPO")
        loads_itself = isinstance(model, str)  # else its weights may not be the checkpoint's
        model = setup.load_model(model, args)
        processing_class = setup.load_processing_class(model, processing_class, args)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        from grpo_agent.train.model_checks import refuse_unsupported_model
        from grpo_agent.train.tree_attention import enable_tree_attention

        refuse_unsupported_model(model, args)
        enable_tree_attention(model)
        from grpo_agent.train import evaluation

        eval_dataset, eval_threshold = evaluation.resolve_eval_split(eval_dataset, environment_factory, args)
        self.reward_funcs, self.tools, self.environment_factory = resolve_plugins(
            reward_funcs, tools, environment_factory, getattr(args, "plugin_args", None)
        )
        _check_dataset(train_dataset, environment_factory, args)
        from grpo_agent.rollout.plugins import check_plugin_args

        # Here, not only in the spawned worker: a misspelled advantage_estimator, prompt filter
        # or plugin_args option fails at construction, before a server is probed.
        check_plugin_args(args, self.reward_funcs)
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if fsdp.world_size() > 1:
            fsdp.apply_fsdp2(model, param_dtype=torch.bfloat16 if args.bf16 else None)
            # The model now owns its sharding and gradient reduction: no DDP wrap by accelerate.
            self.is_distributed_loading_by_transformers = True
        if args.torch_compile:
            compile_decoder_layers(
                model, backend=args.torch_compile_backend, mode=args.torch_compile_mode
            )
        fsdp.install_forward_method(model, "grpo_row_loss", row_loss)
        self.graphed_rows = None  # cuda_graphs: rows replayed through CUDA graphs
        if args.cuda_graphs:
            graphed_rows.check_model(model)
            self.graphed_rows = graphed_rows.GraphedRows(model, build_loss_config(args, model))
        self.phases = collectives.RankPhases(args)  # the collective phase of this rank (FSDP)
        self.window = MetricWindow()
        # This step's rows: losses and metrics stay on the device and are read at the step's end
        # (after the next step's plan), so the host queues row i+1 while the GPU still runs row
        # i (no wait between rows) and plans the next step while the GPU finishes this one.
        self.step_rows = StepRows()
        # NaN/inf steps are filtered from the logged loss once per step, on the values read
        # there; the Trainer's own check waits for the GPU after every row (see read_step_rows).
        self.nan_inf_filter = args.logging_nan_inf_filter
        self._window_losses: list[float] = []
        self._tr_loss_before_step: torch.Tensor | None = None
        self.update_guard = UpdateGuard()  # a NaN/inf gradient norm skips the step's update
        self.row_clock = RowClock(args.device)
        self.ledger = PromptLedger()
        self.model_version = 0
        # The step whose weights `model_version` is (an evaluation's `eval/step`): with
        # weight_sync_steps > 1 an evaluation at a step without a push evaluates an earlier one's.
        self.served_step = 0
        self.source: StepSource | None = None
        self.pusher: Pusher | None = None
        self.synced_lora_name: str | None = None  # the adapter prefix of the last train()'s pushes
        # evaluate() after train() checks the server holds model_version, else pushes it: after
        # merged pushes (the server may have restarted since) or a resume that trained nothing
        self.recheck_served = False
        self._step_samples: list[TrainingSample] = []  # consumed: the oversize dropped too
        self._step_trained: list[TrainingSample] = []  # trained (`take_step_plan`)
        self._planned_ahead = None  # the next step's (plan, samples), from `plan_ahead`
        self._planning = None  # the step planner while rank 0 pulls its samples
        self.step_trained_tokens = 0  # this step's trained (completion) tokens, all processes
        self.step_timings = {"fwd_bwd": 0.0, "fwd": 0.0}  # device seconds, from row_clock
        self.forwarded_tokens_total = 0  # unique (packed) tokens forwarded so far: `num_tokens`
        self.step_forwarded_tokens = 0  # this step's, over all processes
        self.step_flops: float | None = None  # this step's training FLOPs (perf/*_mfu)
        # Evaluation (train/evaluation.py): its callback holds a push while an eval runs.
        self.evaluator = (evaluation.TrainingEvaluator(self, eval_dataset, eval_threshold)
                          if eval_dataset is not None else None)
        self.add_callback(evaluation.EvaluationCallback(self))
        self.add_callback(AsyncStepCallback(self))
        if loads_itself:  # on the weights' device, sharded: as the start push compares them
            remember_loaded_weights(self.model)
        if self.pop_callback(ProgressCallback) is not None:  # only where tqdm is on
            self.add_callback(StepProgressCallback())

    # ------------------------------------------------------------------ lifecycle

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> Any:
        if warning := greedy_sampling_warning(self.args.temperature):
            logger.warning(warning)
        resume_from_checkpoint = resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        restored = self._restored_rollout_state(resume_from_checkpoint)
        self.ledger = PromptLedger(restored)
        self.model_version = restored.model_version
        if resume_from_checkpoint is not None and ends_the_run(
                resume_from_checkpoint, self.args.max_steps, self.prompt_limit()):
            return self._load_ended_run(resume_from_checkpoint)
        threads = setup.set_trainer_threads(self.args)
        if threads is not None:
            logger.info("Trainer uses %d torch thread(s) beside the vLLM server.", threads)
        interrupted = failed = False
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except Exception as error:
            failed = True
            self.phases.raise_if_rank_missing(error)  # a rank that died is named in the report
            raise
        except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, or SIGTERM (`grpo-agent train`)
            interrupted = True
            logger.warning("The run was interrupted (%s) at step %d: stopping the rollout worker "
                           "at once. To go on, %s.", interruption(stop), self.state.global_step,
                           resume_advice(self.args.output_dir, self.resume_setting))
            raise
        finally:
            self.args.logging_nan_inf_filter = self.nan_inf_filter  # if a step raised
            worker_metrics = self._stop_pipeline(at_once=interrupted)
            if failed or interrupted:
                self._log_unlogged_window(worker_metrics)
                if self.evaluator is not None:
                    self.evaluator.log_at_stop()  # e.g. eval_on_start's, if no step ended since
            heap.thaw()  # frozen at train begin (train/step_callback.py)

    def _load_ended_run(self, checkpoint: str) -> TrainOutput:
        """A resume from the run's last step (`ends_the_run`): its model and trainer state,
        nothing trained, no server contacted, no rollout worker started (`grpo-agent train`
        then saves `final`)."""
        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
        self.recheck_served = True  # nothing pushed: evaluate() pushes where the server lacks it
        logger.warning("%s holds the run's last step (%d): nothing is left to train.",
                       checkpoint, self.state.global_step)
        return TrainOutput(self.state.global_step, math.nan, {})

    def _restored_rollout_state(self, checkpoint: str | None) -> RolloutState:
        if checkpoint is None:
            return RolloutState()
        state = RolloutState.load(checkpoint)
        if _is_streaming(self.train_dataset):
            logger.warning(
                "Streaming datasets cannot be repositioned: the rollout worker restarts from "
                "the first prompt (rollout_state.json had %d).", state.first_untrained_prompt_index,
            )
            return RolloutState(model_version=state.model_version)
        return state

    def _save_checkpoint(self, model, trial) -> None:
        step = self.state.global_step
        with (self.phases.during("checkpoint save", step=step),  # gathers on all ranks
              stall.stage("checkpoint_save", step=step)):
            super()._save_checkpoint(model, trial)

    # ------------------------------------------------------------------ batches and loss

    def get_train_dataloader(self) -> Any:
        return _NoBatches()

    def set_initial_training_values(self, args, dataloader):
        """Steps are not known in advance: `max_steps`, or until the prompt epochs are done."""
        max_steps = args.max_steps if args.max_steps > 0 else UNKNOWN_STEPS
        total_batch = self.get_total_train_batch_size(args)
        return 1, max_steps, total_batch * max_steps, total_batch * max_steps, total_batch, (
            max_steps * args.gradient_accumulation_steps
        ), max_steps

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One step's micro-batches for this process, planned from the queue on rank 0."""
        plan = self.take_step_plan()
        self.window.update(plan.metrics)
        # On, transformers reads each row's loss (a host wait per row): off while the rows run,
        # back on at the step's read, which filters the step instead.
        self.args.logging_nan_inf_filter = False
        self._tr_loss_before_step = self._tr_loss.clone() if hasattr(self, "_tr_loss") else None
        rows = [row for rows in plan.microbatches for row in rows]  # every process's
        self.step_forwarded_tokens = sum(row.num_tokens for row in rows)  # packed, as batch/*
        self.step_flops = perf.packed_training_flops(self.model.config, rows)
        self.forwarded_tokens_total += self.step_forwarded_tokens
        rank = torch.distributed.get_rank() if fsdp.world_size() > 1 else 0
        batches = [
            Microbatch(rows[rank], plan.trained_tokens(i)) for i, rows in enumerate(plan.microbatches)
        ]
        # The Trainer steps the optimizer after exactly gradient_accumulation_steps micro-batches;
        # a step the queue could not fill is padded with empty rows (they contribute zero).
        padding = Microbatch(pack_row([]), 1)
        batches += [padding] * (self.args.gradient_accumulation_steps - len(batches))
        return batches, None

    def end_step(self, state) -> bool:
        """After the optimizer step: the last part of pull, train, push. In order: the ledger
        records the step's samples as trained (and its line is written); every
        `weight_sync_steps` steps, and at the run's last (`step_pushes`), the weights are
        pushed and the model version bumped (new groups sample it once the server has it; the
        push may overlap the next step, not the run's end); the worker learns the step's
        tokens (its staleness allowance, which also ends a max_staleness=0 hold) and hands over
        its metrics; epochs are counted in prompts; a finished evaluation is logged (with that
        epoch). Returns True when the run's prompt epochs are done."""
        self.phases.enter("step end", step=state.global_step)  # push, logging, saves
        samples = self._step_samples
        completed = self.ledger.record_trained(samples)
        if fsdp.is_main_process():
            append_ledger_line(self.args.output_dir, state.global_step, completed,
                               self.ledger.take_noticed(), self.ledger.frontier)
        done = self.prompt_epochs_done()
        last = is_last_step(self.args.max_steps, state.global_step, done)
        if self.step_pushes(state.global_step):
            self.model_version += 1
            self.served_step = state.global_step
            self.push_weights()  # retried once after a server restore (train/pipeline.py)
        if last:
            self.settle_push()  # the run ends with its last weights served
        if self.source is not None:
            self.source.finish_step(samples, last=last)
        size = _dataset_size(self.train_dataset)
        if size is not None:
            state.epoch = self.ledger.frontier / size
        if self.evaluator is not None:
            self.evaluator.log_finished()  # after the epoch: the row carries this step's
        return done

    def step_pushes(self, step: int, *, recorded: bool = True) -> bool:
        """Whether `step` ends with a weight push: every `weight_sync_steps`, and the run's last
        step, whose weights would otherwise never reach the server (the run's last evaluation
        and `trainer.evaluate()` after `train()` evaluated an older version, labelled as the
        last step). `recorded=False`: asked before `end_step` recorded the step's samples."""
        in_hand = () if recorded else self._step_samples
        return step % self.args.weight_sync_steps == 0 or is_last_step(
            self.args.max_steps, step, self.prompt_epochs_done(in_hand))

    def prompt_limit(self) -> int | None:
        """The run's prompts, `num_train_epochs` of the dataset (without `max_steps`): prompt
        indices from here on belong to no epoch the run trains."""
        return prompt_limit(self.args, self.train_dataset)

    def prompt_epochs_done(self, in_hand: list[TrainingSample] = ()) -> bool:
        """`num_train_epochs` counted in prompts (without `max_steps`): all consumed, counting
        the samples `in_hand` (the step being filled) as trained."""
        limit = self.prompt_limit()
        return limit is not None and self.ledger.frontier_after(list(in_hand)) >= limit

    def _prepare_inputs(self, inputs: Any) -> Any:
        return inputs  # rows move to the device inside the forward

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.row_clock.start_row()
        if self.graphed_rows is not None and self.graphed_rows.takes(inputs.row):
            loss = self._graphed_training_step(inputs, num_items_in_batch)
        else:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.row_clock.end_row()
        self.step_rows.add_loss(loss)
        return loss

    def _graphed_training_step(self, inputs: Microbatch, num_items_in_batch) -> torch.Tensor:
        """The row's step replayed through its CUDA graph (`cuda_graphs`): it backpropagates
        what transformers' `training_step` would from `compute_loss` (divided by the
        accumulation steps where transformers divides) and returns that loss."""
        self.model.train()
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None
                      ) or self.compute_loss_func is not None
        divisor = 1 if scaled else self.current_gradient_accumulation_steps
        loss, metrics = self.graphed_rows.step(inputs.row, 1.0 / (inputs.num_trained_global * divisor))
        self.row_clock.forward_unseen()
        self.step_rows.add_metrics(metrics, inputs.row.num_trained)
        return loss

    def read_step_rows(self) -> None:
        """The step's losses, loss metrics (over all processes) and device timings, read once
        its last backward has run. A NaN/inf step loss is kept out of the Trainer's running
        loss and of the logged one (`logging_nan_inf_filter`)."""
        reading = self.step_rows.read(next(self.model.parameters()).device, fsdp.world_size())
        self.args.logging_nan_inf_filter = self.nan_inf_filter
        self.window.update(reading.metrics)
        self.step_timings = self.row_clock.read()
        self._window_losses.append(reading.loss)
        bad = self.nan_inf_filter and not math.isfinite(reading.loss)
        if bad and self._tr_loss_before_step is not None:
            self._tr_loss.copy_(self._tr_loss_before_step)
        self.window.add("optimizer/skipped_step_count", self.update_guard.read(self.state.global_step))
        self.update_guard.stop_if_stuck()  # after the count: the failed run's last row has it

    def _get_grad_norm(self, model, grad_norm=None):
        """transformers' gradient norm of the step (clipped or not), computed before the
        optimizer step: where it is NaN/inf the step's update is skipped (train/update_guard.py)."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.update_guard.arm(self.optimizer, grad_norm)
        return grad_norm

    def compute_loss(self, model, inputs: Microbatch, return_outputs=False, num_items_in_batch=None):
        if not hasattr(self, "_loss_config"):
            self._loss_config = build_loss_config(self.args, self.model)
        loss, metrics = self.model.grpo_row_loss(
            inputs.row, self._loss_config, inputs.num_trained_global
        )
        self.row_clock.forward_done()
        self.step_rows.add_metrics(metrics, inputs.row.num_trained)
        # Each rank's loss is normalised by all ranks' trained tokens; FSDP averages gradients.
        loss = loss * fsdp.world_size()
        return (loss, None) if return_outputs else loss

    def floating_point_ops(self, inputs: Microbatch) -> int:
        return int(perf.packed_training_flops(self.model.config, [inputs.row]) or 0)

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            # The Trainer's number (mean step loss over the window), without NaN/inf steps
            # when filtering: their loss is replaced by the window's mean, as HF documents.
            losses = [loss for loss in self._window_losses
                      if math.isfinite(loss) or not self.nan_inf_filter]
            logs["loss"] = sum(losses) / len(losses) if losses else math.nan
            self._window_losses = []
            logs.update(self.window_summary())
            logs["num_tokens"] = float(self.forwarded_tokens_total)
            if self.args.log_completions and fsdp.is_main_process():
                from grpo_agent.train.reporting import print_completions

                print_completions(self._step_trained, self.processing_class,
                                  self.args.num_completions_to_print, self.state.global_step)
        super().log(logs, start_time)

    def _log_unlogged_window(self, worker_metrics: list[Observation]) -> None:
        """A run that stops on an error or an interrupt (Ctrl-C, SIGTERM) logs what it counted
        since its last logged step (e.g. `rollout/server_lost_group_count` of a lost server, or
        the rewards of the steps a `logging_steps` window had not logged yet): whoever debugs or
        resumes the stopped run needs it. The row is marked `stop/window_steps` (the steps it
        covers) and has no `loss`, so the plot and the progress line skip it. It never hides
        the error or the interrupt being raised (a second Ctrl-C still cuts it short).
        The covered steps' losses are dropped with it: a resume by a later `train()` call would
        average them into its first row, and it trains those steps again."""
        self._window_losses = []
        try:
            self.window.extend(worker_metrics)
            if self.window:
                step = self.state.global_step
                covered = step - getattr(self, "_globalstep_last_logged", step)  # transformers'
                self.log({**self.window_summary(), STOP_WINDOW_STEPS: float(max(covered, 0))})
        except Exception:  # the run's own error is the one to see
            logger.exception("Logging the metrics counted since the last logged step failed.")

    def evaluate(self, eval_dataset: Any = None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """One blocking evaluation of the served version on the eval split (`eval/*` metrics)."""
        from grpo_agent.train.evaluation import evaluate_now

        return evaluate_now(self, eval_dataset)

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler: bool = False):
        """During train(): start an evaluation beside training (train/evaluation.py)."""
        from grpo_agent.train.evaluation import start_training_eval

        return start_training_eval(self)

    def window_summary(self) -> dict[str, float]:
        """The window's metrics; perf/* that no step measured (e.g. MFU on CPU) are left out."""
        summary = self.window.summarize()
        return {k: v for k, v in summary.items() if not (k.startswith("perf/") and math.isnan(v))}


def interruption(stop: BaseException) -> str:
    """What interrupted the run: SystemExit(128 + signal number) is how the CLI turns SIGTERM
    into an exit that runs the cleanup."""
    code = getattr(stop, "code", None)
    if isinstance(code, int) and code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(code - 128).name
    return type(stop).__name__


def prompt_limit(args: AsyncGRPOConfig, dataset: Any) -> int | None:
    """`AsyncGRPOTrainer.prompt_limit` of a run with these settings and train dataset."""
    size = _dataset_size(dataset)
    if args.max_steps > 0 or size is None:
        return None
    return math.ceil(args.num_train_epochs * size)


def _dataset_size(dataset: Any) -> int | None:
    if dataset is None or _is_streaming(dataset):
        return None
    return len(dataset)


def _is_streaming(dataset: Any) -> bool:
    return dataset is not None and not hasattr(dataset, "__len__")


def _refuse_agent_only_envs(environment_factory: Any) -> None:
    """An `agent_only` env (verifiers) has no episode for the built-in tool loop: its reset()
    refuses every group, and the run would stop only after 10 of them."""
    from grpo_agent.rollout.environments import agent_only_name

    factories = (environment_factory.values() if isinstance(environment_factory, dict)
                 else [environment_factory])
    for factory in factories:
        if isinstance(factory, str):
            from grpo_agent.plugins import load_registry

            try:
                factory = load_registry().environment_spec(factory)
            except Exception:  # noqa: BLE001, S112 -- resolve_plugins reports an unknown name
                continue
        if agent := agent_only_name(factory):
            raise ValueError(
                f"environment_factory {getattr(factory, '__name__', factory)!r} is played by its "
                f"own agent program ({agent!r}), not the built-in tool loop: use "
                f"HarnessAsyncGRPOTrainer(agent={agent!r}, train_dataset=<the env's rows>) "
                f"(CLI: --agent {agent}).")


def _check_dataset(dataset: Any, environment_factory: Any, args: AsyncGRPOConfig) -> None:
    if dataset is None:
        if environment_factory is None:
            raise ValueError(
                "train_dataset is required unless environment_factory provides the prompts "
                "from reset(); pass a dataset with a conversational 'prompt' column."
            )
        if args.max_steps <= 0:
            raise ValueError(
                "Without a train_dataset the run length is unknown: set max_steps > 0."
            )
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and environment_factory is None:
        raise ValueError(
            f"train_dataset has columns {columns} but no 'prompt' column. Rename the column with "
            "the conversational prompt to 'prompt' (a list of {'role', 'content'} messages)."
        )
