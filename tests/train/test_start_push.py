"""The push before the first rollout (`RolloutPipelineMixin.start_pipeline`): which version it
is, that it has landed before the rollout worker starts, and that the worker starts on that
version and learns each later one from the pusher. The trainer and its pipeline code are real
(tiny model, CPU); the server probe, the pusher and the worker process are stand-ins."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.testing.offline import OfflineTrainer
from grpo_agent.train import pipeline, setup
from grpo_agent.train.trainer import AsyncGRPOTrainer


class RecordingPusher:
    """The `Pusher` seam: records what the trainer asks of it, in order."""

    lora_name = None

    def __init__(self, events, initial_push):
        self.events, self.initial_push = events, initial_push
        self.on_served = None

    def needs_initial_push(self, model, holds_pushed_weights):
        return self.initial_push

    def push(self, model, version):
        self.events.append(("push", version))
        return {}

    def wait(self):
        self.events.append(("landed",))
        return {}

    def close(self):
        self.events.append(("close",))


def _worker_class(events):
    class Worker:
        """The rollout worker's trainer-side seam, no process."""

        pid = None

        def __init__(self, loop_cls, **kwargs):
            pass

        def set_model_version(self, version):
            events.append(("worker version", version))

        def start(self):
            events.append(("worker start",))

        def stop(self, grace_s=None):
            pass

        def drain_metrics(self):
            return []

    return Worker


@pytest.mark.parametrize(("global_step", "model_version", "initial_push", "expected"), [
    # a fresh run on a server that serves the model's own weights: nothing to push
    (0, 0, False, [("worker version", 0), ("worker start",)]),
    # a trained adapter passed in, or a server an earlier run pushed into: version 1 first
    (0, 0, True, [("push", 1), ("landed",), ("worker version", 1), ("worker start",)]),
    # a resumed run at version 2: the fresh server gets the trained weights as version 3
    (4, 2, False, [("push", 3), ("landed",), ("worker version", 3), ("worker start",)]),
])
def test_the_worker_starts_on_the_version_the_start_push_landed(
        tmp_path, monkeypatch, global_step, model_version, initial_push, expected):
    """Groups are labelled with the worker's version (`pin_rollout_version`), which the
    staleness rule and `sample/staleness_*` read: it must be the version the server serves
    when the first group starts, and follow each later push (`on_served`)."""
    events = []
    facts = SimpleNamespace(model_id="tiny", max_model_len=512, holds_pushed_weights=False,
                            weight_transfer_backend="gloo", lora=None)
    monkeypatch.setattr(setup, "check_server", lambda args, model: facts)
    monkeypatch.setattr(pipeline, "RolloutWorker", _worker_class(events))
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                           token_budget=64, vllm_server_base_url="http://127.0.0.1:9")
    trainer = OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                             train_dataset=[{"prompt": []}] * 8)
    trainer.pusher_factory = lambda args, model, facts: RecordingPusher(events, initial_push)
    trainer.state.global_step, trainer.model_version = global_step, model_version
    AsyncGRPOTrainer.start_pipeline(trainer)  # the real one (OfflineTrainer's has no server)
    try:
        assert events == expected
        assert trainer.model_version == expected[-2][1]
        # pulls count staleness from the version that trains the step (`StepSource`)
        assert trainer.source.trained_version() == trainer.model_version
        assert trainer.pusher.on_served == trainer.source.worker.set_model_version
    finally:
        trainer._stop_pipeline()
