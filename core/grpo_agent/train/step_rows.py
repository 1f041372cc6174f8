"""A step's row losses and loss metrics, read once per optimizer step over all processes.

Design decision: reading a device value makes the host wait for the GPU, so each row's loss
and its `loss_metrics` (0-d device tensors) stay on the device while the step's rows are
queued back to back. At the step's end they are reduced on the device into one vector per
process, gathered (one all-gather under FSDP) and read in one transfer. The reduction follows
the window rule of `grpo_agent.metrics` over every process's rows: a mean is weighted by the
rows' trained tokens (a mean over the step's trained tokens), a max or min is the extreme.
Each step is then one observation of the logging window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_agent.metrics import reduction_for
from grpo_agent.train.loss import LOSS_METRIC_NAMES

_EMPTY = {"max": -torch.inf, "min": torch.inf}


@dataclass
class StepReading:
    metrics: dict[str, float]  # the loss metrics any process's rows produced
    loss: float  # the rows' summed loss (as the Trainer sums it), averaged over processes


class StepRows:
    """Collects this process's rows of one step; `read` reduces them over all processes."""

    def __init__(self) -> None:
        self._metrics: list[tuple[dict[str, torch.Tensor], int]] = []
        self._losses: list[torch.Tensor] = []

    def add_metrics(self, metrics: dict[str, torch.Tensor], num_trained: int) -> None:
        unknown = set(metrics) - set(LOSS_METRIC_NAMES)
        if unknown:
            raise ValueError(f"{sorted(unknown)} missing from loss.LOSS_METRIC_NAMES")
        self._metrics.append((metrics, num_trained))

    def add_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def read(self, device: torch.device, world_size: int = 1) -> StepReading:
        """Reduce and read the step (a collective when world_size > 1: every process calls it)."""
        local = self._local_vector(device)
        self._metrics, self._losses = [], []
        if world_size > 1:
            gathered = [torch.empty_like(local) for _ in range(world_size)]
            torch.distributed.all_gather(gathered, local)
            local = torch.stack(gathered)
        return _combine(local.reshape(world_size, -1).tolist())

    def _local_vector(self, device: torch.device) -> torch.Tensor:
        """Per name (value, rows that have it), then the loss: built on the device, no read."""
        def const(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=torch.float64, device=device)

        slots = []
        for name in LOSS_METRIC_NAMES:
            rows = [(m[name].detach().double().reshape(()), n) for m, n in self._metrics if name in m]
            kind = reduction_for(name)
            if not rows:
                value = const(_EMPTY.get(kind, 0.0))
            elif kind == "mean":
                value = torch.stack([v * n for v, n in rows]).sum()
            else:
                stacked = torch.stack([v for v, _ in rows])
                value = stacked.max() if kind == "max" else stacked.min()
            weight = sum(n for _, n in rows) if kind == "mean" else len(rows)
            slots += [value.to(device), const(float(weight))]
        losses = [loss.double().reshape(()).to(device) for loss in self._losses]
        slots.append(torch.stack(losses).sum() if losses else const(0.0))
        return torch.stack(slots)


def _combine(per_process: list[list[float]]) -> StepReading:
    metrics = {}
    for i, name in enumerate(LOSS_METRIC_NAMES):
        values = [row[2 * i] for row in per_process if row[2 * i + 1] > 0]
        weights = [row[2 * i + 1] for row in per_process if row[2 * i + 1] > 0]
        if not values:
            continue
        kind = reduction_for(name)
        if kind == "mean":
            metrics[name] = sum(values) / sum(weights)
        else:
            metrics[name] = max(values) if kind == "max" else min(values)
    loss = sum(row[-1] for row in per_process) / len(per_process)
    return StepReading(metrics, loss)
