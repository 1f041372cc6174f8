"""A trainer without a server: scripted samples in place of the rollout worker, no weight push.

For tests and GPU benchmarks of the training step itself (planner, packing, loss, metrics,
optimizer): `OfflineTrainer(...)` with `trainer.samples` set before `train()` gets every sample
at its first pull, as if the worker had generated them all at model version 0.
"""
from __future__ import annotations

from grpo_agent.train.trainer import AsyncGRPOTrainer


class ScriptedWorker:
    """The rollout worker's seam: every sample at the first pull, nothing after."""

    def __init__(self, samples):
        self.batches = [samples]

    def pull(self, timeout, version=None):
        return self.batches.pop(0) if self.batches else []

    def set_model_version(self, version): ...
    def recheck_carry(self, carry, version=None): return carry  # version 0 throughout: never stale
    def hold_admission(self): ...
    def report_step_tokens(self, tokens): ...
    def drain_metrics(self): return []
    def finish(self, timeout_s): return True
    def stop(self, grace_s: float | None = None): ...


class NoPush:
    lora_name = None

    def push(self, model, version):
        return {}

    def wait(self):
        return {}

    def close(self): ...


class OfflineTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer with scripted samples (`self.samples`) instead of a server and a
    rollout worker."""

    def start_pipeline(self):
        self._use_token_budget(self.args.token_budget)  # as the real one (before its worker)
        self.pusher = NoPush()
        self.source = self._step_source(ScriptedWorker(list(self.samples)))
