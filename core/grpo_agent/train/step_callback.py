"""`AsyncStepCallback`: the trainer's hooks between optimizer steps, and each step's perf metrics.

Design decision: `transformers.Trainer` runs the training loop and calls callbacks at fixed
points; this one only forwards them to the trainer (`start_pipeline`, `end_step`,
`plan_ahead`, `read_step_rows`, the ledger on save) and times the step, so the order of a
step lives in one place, `AsyncGRPOTrainer.end_step`.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from transformers import TrainerCallback

from grpo_agent.train import fsdp, heap, perf


class AsyncStepCallback(TrainerCallback):
    """Forwards the Trainer's step events to an `AsyncGRPOTrainer`; records perf/* per step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._step_started = time.perf_counter()
        self._optimizer_started = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.start_pipeline()
        heap.freeze_long_lived()  # the model, optimizer and pipeline: out of later collections
        self._step_started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_started = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.window.add("perf/optimizer_s", time.perf_counter() - self._optimizer_started)

    def on_step_end(self, args, state, control, **kwargs):
        """After transformers' own step end (which decides saving, evaluating, stopping): the
        step's end, the next step's plan while the GPU finishes this one, then the one wait
        for the GPU (the step's losses, metrics and timings) before the step is logged."""
        done = self.trainer.end_step(state)
        if state.global_step == 1:
            heap.freeze_long_lived()  # what the first step built: compiled graphs, buffers
        if done:
            control.should_training_stop = True
        if control.should_training_stop and args.logging_strategy != "no":
            # transformers logs every logging_steps only: the steps since the last row (3 of
            # max_steps=3 at logging_steps=2, or a prompt epoch's end) were never logged
            control.should_log = True
        self.trainer.plan_ahead(control)
        self.trainer.read_step_rows()
        self._record_step_metrics()

    def on_save(self, args, state, control, **kwargs):
        if fsdp.is_main_process():
            folder = f"{args.output_dir}/checkpoint-{state.global_step}"
            self.trainer.ledger.state(self.trainer.model_version).save(folder)

    def _record_step_metrics(self) -> None:
        trainer = self.trainer
        now = time.perf_counter()
        step_s = now - self._step_started
        self._step_started = now
        fwd_bwd_s, fwd_s = trainer.step_timings["fwd_bwd"], trainer.step_timings["fwd"]
        forwarded = trainer.step_forwarded_tokens
        window = trainer.window
        window.add("perf/step_s", step_s)
        window.add("perf/fwd_bwd_s", fwd_bwd_s)
        if fwd_s is not None:  # None: every row replayed a CUDA graph (cuda_graphs)
            window.add("perf/fwd_s", fwd_s)
        window.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, fwd_bwd_s)
        window.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        window.add_rate("perf/wall_clock_trained_tokens_per_s", trainer.step_trained_tokens, step_s)
        peak = _device_peak(trainer.args)
        for name, seconds in (("perf/fwd_bwd_mfu", fwd_bwd_s), ("perf/wall_clock_mfu", step_s)):
            value = perf.mfu(trainer.step_flops, seconds, peak, fsdp.world_size())
            if value is not None:
                window.add(name, value)


def _device_peak(args: Any) -> float | None:
    if not torch.cuda.is_available() or args.use_cpu:
        return None
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return perf.peak_flops_per_s(torch.cuda.get_device_name(), precision)
