"""Checkpoints of an FSDP2-sharded model: gathered to full tensors, written by rank 0.

Design decision: a checkpoint must load on any number of processes (and in `transformers`
without us), so shards are gathered into the ordinary full state dict and optimizer state on
save, and scattered again on load. With one process the Trainer's own methods run unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from grpo_agent.train import fsdp


class ShardedCheckpointMixin:
    """Put before `transformers.Trainer` in the bases of a trainer whose model FSDP2 shards."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if fsdp.world_size() == 1:
            return super().save_model(output_dir, _internal_call)
        state = fsdp.full_model_state(self.model)  # every rank gathers, rank 0 writes
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if fsdp.world_size() == 1:
            return super()._save_optimizer_and_scheduler(output_dir)
        state = fsdp.full_optimizer_state(self.model, self.optimizer)
        if self.args.should_save:
            torch.save(state, Path(output_dir) / OPTIMIZER_NAME)
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if fsdp.world_size() == 1:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file

        files = sorted(Path(resume_from_checkpoint).glob("model*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{resume_from_checkpoint} holds no model*.safetensors to resume from.")
        state = {k: v for f in files for k, v in load_file(f).items()}
        fsdp.load_full_model_state(model or self.model, state)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or fsdp.world_size() == 1:
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = torch.load(Path(checkpoint) / OPTIMIZER_NAME, map_location="cpu", weights_only=False)
        fsdp.load_full_optimizer_state(self.model, self.optimizer, state)
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True))
