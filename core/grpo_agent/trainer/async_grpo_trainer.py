"""Alias of `trl.trainer.async_grpo_trainer`: the same classes, not copies.

`AsyncGRPOTrainer` loads lazily, so a custom loop module that imports `AsyncRolloutLoop` from
here (as the spec's CurriculumRolloutLoop does) does not pull the trainer into the worker.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord

__all__ = ["AsyncGRPOTrainer", "AsyncRolloutLoop", "Rollout", "RolloutGroup", "TrainingSequence",
           "TurnRecord"]

if TYPE_CHECKING:  # pragma: no cover
    from grpo_agent.train.trainer import AsyncGRPOTrainer


def __getattr__(name: str) -> Any:
    if name == "AsyncGRPOTrainer":
        from grpo_agent.train.trainer import AsyncGRPOTrainer

        return AsyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
