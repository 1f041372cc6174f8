"""Helpers of the spec example tests: the config every example changes, and a recorded run."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def spec_args(server, tmp_path, config_cls=None, **changes):
    """The spec's defaults with only what a 2-core CPU test needs changed: the server URL and
    output folder, one step, 4 rollouts of at most 16 tokens, rows of 256 tokens, no saves.
    `config_cls`: an `AsyncGRPOConfig` subclass (default: `AsyncGRPOConfig`)."""
    from grpo_agent import AsyncGRPOConfig

    settings = {
        "output_dir": str(tmp_path / "run"), "vllm_server_base_url": server.base_url,
        "max_steps": 1, "num_generations": 4, "max_completion_length": 16, "token_budget": 256,
        "save_strategy": "no",
    }
    return (config_cls or AsyncGRPOConfig)(**{**settings, **changes})


@dataclass
class RecordedRun:
    """Everything a run observed: each logged window's raw observations and the whole run's
    (including what the worker sent after the last log), plus the trained samples per step."""

    trainer: object
    observations: list = field(default_factory=list)
    windows: list = field(default_factory=list)
    step_samples: list = field(default_factory=list)
    notices: list = field(default_factory=list)  # prompts consumed without samples (reason)
    versions: list = field(default_factory=list)  # the trainer's model version after each step
    substeps: int = 0  # micro-batches that ended without an optimizer step

    @property
    def logs(self) -> list[dict]:
        return [entry for entry in self.trainer.state.log_history if "loss" in entry]

    def values(self, name: str) -> list[float]:
        """Every plain observation of `name` over the run, in order."""
        return [value for key, value in self.observations if key == name]

    @property
    def trained(self) -> list:
        return [sample for samples in self.step_samples for sample in samples]


def record_run(trainer, **train_kwargs) -> RecordedRun:
    """Train with a recording metric window; returns the run's observations and samples."""
    from grpo_agent.metrics import MetricWindow
    from transformers import TrainerCallback

    run = RecordedRun(trainer)

    class RecordingWindow(MetricWindow):
        def __init__(self):
            super().__init__()
            self.current: list = []

        def add(self, name, value):
            super().add(name, value)
            self.note([(name, float(value))])

        def add_rate(self, name, amount, seconds):
            super().add_rate(name, amount, seconds)
            self.note([(name, (float(amount), float(seconds)))])

        def note(self, observations):
            self.current += observations
            run.observations.extend(observations)

        def summarize(self):
            run.windows.append(self.current)
            self.current = []
            return super().summarize()

    workers = []

    class StepRecorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ledger = trainer.ledger
            record_consumed = ledger.record_consumed

            def record(notice):
                run.notices.append(notice)
                record_consumed(notice)

            ledger.record_consumed = record

        def on_substep_end(self, args, state, control, **kwargs):
            run.substeps += 1

        def on_step_end(self, args, state, control, **kwargs):
            run.step_samples.append(list(trainer._step_samples))
            run.versions.append(trainer.model_version)
            if trainer.source is not None and not workers:
                workers.append(trainer.source.worker)

    trainer.window = RecordingWindow()
    trainer.add_callback(StepRecorder())
    trainer.train(**train_kwargs)
    for worker in workers:  # what the worker flushed after the last window (it has stopped)
        trainer.window.extend(worker.drain_metrics())
    return run


def spec_reduce(name: str, observations: list) -> float:
    """The spec's window rule, written from the spec: rates are total over total seconds; the
    word `count` in the name's last part sums, `max`/`min` keep the extreme, else the mean."""
    rates = [value for value in observations if isinstance(value, tuple)]
    if rates:
        seconds = sum(s for _, s in rates)
        return sum(a for a, _ in rates) / seconds if seconds > 0 else math.nan
    values = [v for v in observations if not math.isnan(v)]
    words = name.rsplit("/", 1)[-1].split("_")
    if "count" in words:
        return float(sum(values))
    if not values:
        return math.nan
    if "max" in words:
        return max(values)
    if "min" in words:
        return min(values)
    return sum(values) / len(values)


def served_weight_version(base_url: str) -> str | None:
    """The weight version the server samples with now (the label of the last push)."""
    import asyncio

    from grpo_agent.sampler.client import SamplerClient, SamplingParams

    async def probe():
        async with SamplerClient(base_url, timeout=60) as client:
            turn = await client.generate([0], SamplingParams(max_tokens=1, num_logprobs=0))
            return turn.weight_versions[0] if turn.weight_versions else None
    return asyncio.run(probe())
