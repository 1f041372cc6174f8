"""Under several processes each row's loss is divided by its micro-batch's trained tokens over
every process, then scaled by the number of processes (FSDP averages gradients): the token
mean over the micro-batch, whatever the rows' sizes. The FSDP tests use rows of equal size,
where a per-row divisor gives the same numbers, so the rule is held here at its seam."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from grpo_agent.train import fsdp
from grpo_agent.train.batching import StepPlan
from grpo_agent.train.packing import pack_row
from grpo_agent.train.trainer import AsyncGRPOTrainer, Microbatch

from .conftest import make_sample


def _row(trained: int):
    """One 12-token sample whose last `trained` tokens are trained."""
    mask = [0] * (12 - trained) + [1] * trained
    return pack_row([make_sample(range(1, 13), mask, seed=trained)])


def test_each_rank_gets_its_row_and_the_micro_batchs_trained_tokens_over_all_ranks(
        tiny_qwen3, monkeypatch):
    rows = [[_row(3), _row(7)], [_row(5), _row(1)]]  # micro-batch i, process j
    plan = StepPlan(microbatches=rows, metrics={}, dropped=[], leftover=[])
    monkeypatch.setattr(fsdp, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    host = SimpleNamespace(
        take_step_plan=lambda: plan, window=SimpleNamespace(update=lambda metrics: None),
        args=SimpleNamespace(logging_nan_inf_filter=True, gradient_accumulation_steps=3),
        model=tiny_qwen3, forwarded_tokens_total=0)
    batches, _ = AsyncGRPOTrainer.get_batch_samples(host, None, 3, None)
    assert [(b.row, b.num_trained_global) for b in batches[:2]] == [(rows[0][1], 10), (rows[1][1], 6)]
    assert batches[2].row.num_trained == 0  # the accumulation step the queue did not fill
    # num_tokens (and the step's FLOPs) count every process's rows, not this one's
    assert host.step_forwarded_tokens == host.forwarded_tokens_total == 4 * 12


def test_each_ranks_loss_is_scaled_by_the_number_of_ranks(monkeypatch):
    """The row loss already divides by all ranks' trained tokens; FSDP's gradient average
    divides by the ranks again, so compute_loss multiplies it back."""
    monkeypatch.setattr(fsdp, "world_size", lambda: 4)
    row = _row(3)
    host = SimpleNamespace(
        _loss_config=None, row_clock=SimpleNamespace(forward_done=lambda: None),
        step_rows=SimpleNamespace(add_metrics=lambda metrics, n: None),
        model=SimpleNamespace(grpo_row_loss=lambda row, cfg, total: (torch.tensor(0.25), {})))
    loss = AsyncGRPOTrainer.compute_loss(host, host.model, Microbatch(row, 12))
    assert loss.item() == pytest.approx(1.0)


def test_a_graphed_row_is_scaled_and_weighed_as_an_eager_one():
    """cuda_graphs=True backpropagates inside the row's graph, so `_graphed_training_step` scales
    the loss itself: by 1 / (the micro-batch's trained tokens x the accumulation steps), what
    compute_loss and transformers' division give an eager row; its metrics count the row's
    trained tokens. (The graphed path's own tests need a GPU.)"""
    row = _row(3)
    scales, weights = [], []

    def step(row, scale):
        scales.append(scale)
        return torch.tensor(0.25), {}

    host = SimpleNamespace(
        model=SimpleNamespace(train=lambda: None), loss_is_scaled_for_ga=None,
        model_accepts_loss_kwargs=True, compute_loss_func=None,
        current_gradient_accumulation_steps=4, graphed_rows=SimpleNamespace(step=step),
        row_clock=SimpleNamespace(forward_unseen=lambda: None),
        step_rows=SimpleNamespace(add_metrics=lambda metrics, n: weights.append(n)))
    AsyncGRPOTrainer._graphed_training_step(host, Microbatch(row, 12), num_items_in_batch=None)
    assert scales == [pytest.approx(1 / (12 * 4))] and weights == [3]
