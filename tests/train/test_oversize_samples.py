"""Samples longer than token_budget: the step planner drops them, but their prompts are
consumed. What a step trains (its trained tokens, staleness, printed completions) leaves them
out; what it consumes (`_step_samples`, which the ledger records) keeps them."""
from __future__ import annotations

import dataclasses
import time

from grpo_agent.metrics import MetricWindow
from grpo_agent.train.batching import StepPlanner, plan_step
from grpo_agent.train.checkpoint import PromptLedger
from grpo_agent.train.pipeline import RolloutPipelineMixin
from grpo_agent.train.step_source import StepSource
from grpo_agent.types import PromptConsumed

from .conftest import make_sample

BUDGET = 8


def _sample(tokens: int, prompt: int, *, version: int = 0):
    """A sample of `tokens` tokens, its last half trained, the only one of prompt `prompt`."""
    trained = [0] * (tokens - tokens // 2) + [1] * (tokens // 2)
    sample = make_sample(range(1, tokens + 1), trained, group_id=prompt, seed=prompt)
    return dataclasses.replace(sample, prompt_index=prompt, model_version=version)


class QueuedWorker:
    """The rollout worker's trainer-side seam: each pull takes the next queued list."""

    pid = None
    queue_size = 0

    def __init__(self, pulls: list[list], *, model_version: int = 0) -> None:
        self.pulls = pulls
        self.model_version = model_version

    def pull(self, timeout, version=None):
        return self.pulls.pop(0) if self.pulls else []

    def report_step_tokens(self, tokens):
        pass

    def drain_metrics(self):
        return []


def test_a_steps_trained_tokens_and_printed_completions_leave_out_its_oversize_samples():
    fits, oversize = _sample(6, 0), _sample(BUDGET + 10, 1)
    plan = plan_step([fits, oversize], token_budget=BUDGET, num_processes=1, grad_accum_steps=1)
    host = type("Host", (), {})()
    host._planned_ahead = (plan, [fits, oversize])
    assert RolloutPipelineMixin.take_step_plan(host) is plan
    assert host.step_trained_tokens == fits.sequence.num_trained == 3
    assert host._step_samples == [fits, oversize]  # both prompts consumed
    assert host._step_trained == [fits]  # log_completions prints these


def test_a_steps_staleness_leaves_out_its_oversize_samples():
    """An oversize sample of an old version is dropped, not trained: it says nothing about the
    log-prob gap of the step's update."""
    worker = QueuedWorker([[_sample(6, 0, version=2), _sample(BUDGET + 10, 1, version=0)]])
    window = MetricWindow()
    source = StepSource(worker, ledger=PromptLedger(), epochs_done=lambda taken=(): not worker.pulls,
                        window=window, no_progress_timeout=0, trained_version=lambda: 2)
    taken, _ = source.next_step(StepPlanner(token_budget=BUDGET, num_processes=1, grad_accum_steps=1))
    assert [s.prompt_index for s in taken] == [0, 1]
    source.finish_step(taken, last=False)
    metrics = window.summarize()
    assert metrics["sample/staleness_max"] == metrics["sample/staleness_mean"] == 0.0


def test_the_starvation_warning_counts_the_samples_the_step_will_train(monkeypatch, caplog):
    """A run that trained nothing warned "this step holds 712": the count took the step's
    oversize samples, which the planner drops."""
    from grpo_agent.train import step_source

    monkeypatch.setattr(step_source, "STARVED_WARNING_S", 0.1)
    worker = SlowWorker([[_sample(6, 0)], *([_sample(BUDGET + 10, p)] for p in range(1, 4))])
    source = StepSource(worker, ledger=PromptLedger(), epochs_done=lambda taken=(): not worker.pulls,
                        window=MetricWindow(), no_progress_timeout=0)
    with caplog.at_level("WARNING", logger=step_source.__name__):
        taken, _ = source.next_step(StepPlanner(token_budget=BUDGET, num_processes=1, grad_accum_steps=1))
    assert len(taken) == 4
    held = [r.getMessage().split("(")[1].split(")")[0] for r in caplog.records
            if r.name == step_source.__name__]
    assert len(held) >= 2 and set(held) == {"this step holds 1"}, held


class SlowWorker(QueuedWorker):
    """Each pull takes 0.15 s: the starvation clock runs."""

    def pull(self, timeout, version=None):
        time.sleep(0.15)
        return super().pull(timeout, version)


def test_the_no_progress_guard_counts_oversize_samples_per_group(caplog):
    """The no-progress cause read "the last 839 groups were all dropped (712 oversize_sample,
    127 zero_std)": oversize counted per sample, the rest per group. A group counts once, and
    not at all if one of its samples trained; the window of 8 is groups too."""
    def group(prompt: int, tokens: int = BUDGET + 10, n: int = 4) -> list:
        return [dataclasses.replace(_sample(tokens, prompt), group_num_samples=n) for _ in range(n)]

    worker = QueuedWorker([[_sample(6, 0), _sample(BUDGET + 10, 0)],  # group 0 trains
                           group(1), [PromptConsumed(2, 2, "zero_std")], group(3)])
    source = StepSource(worker, ledger=PromptLedger(), epochs_done=lambda taken=(): not worker.pulls,
                        window=MetricWindow(), no_progress_timeout=0)
    with caplog.at_level("WARNING", logger="grpo_agent.train.no_progress"):
        source.next_step(StepPlanner(token_budget=BUDGET, num_processes=1, grad_accum_steps=1))
    cause = source.no_progress.cause(0.0)
    assert cause.startswith("the last 3 groups were all dropped (2 oversize_sample, 1 zero_std)"), cause
    assert "No progress" not in caplog.text  # 3 groups (9 samples) are no window of 8 groups
