"""A checkpoint write that hangs (a stuck network filesystem) through the trainer's own
`_save_checkpoint`: the stall report names `checkpoint_save` and the step. (The write is let
go once the report is there; past the grace period the process would exit with code 3, which
`test_stall_watch.py` shows for a fatal stage.)"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer, stall
from grpo_agent.testing import build_tiny_model
from transformers import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome


def no_reward(completion_ids, **kwargs):
    return [0.0] * len(completion_ids)


def test_a_hung_checkpoint_write_is_named(tmp_path, monkeypatch, record_property):
    monkeypatch.setattr(stall, "ABORT_GRACE_S", 600.0)
    report_path = tmp_path / stall.REPORT_NAME
    entered = threading.Event()

    def write_that_hangs_until_reported(self, model, trial):
        entered.set()
        deadline = time.monotonic() + 120
        while not report_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    monkeypatch.setattr(Trainer, "_save_checkpoint", write_that_hangs_until_reported)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                           stall_timeouts={"checkpoint_save": 1}, save_strategy="no")
    trainer = AsyncGRPOTrainer(model=str(build_tiny_model()), reward_funcs=no_reward,
                               train_dataset=[{"prompt": "hi"}], args=args)
    trainer.state.global_step = 6
    watch = stall.StallWatch(args, "trainer").start()
    started = time.time()
    try:
        trainer._save_checkpoint(trainer.model, None)
    finally:
        watch.stop()
    assert entered.is_set()
    # The outcome is the report (the run would then stop): when the monitor wrote it.
    record_fault_to_outcome(record_property, report_path.stat().st_mtime - started, 1.0)
    report = json.loads(report_path.read_text())
    assert (report["stage"], report["step"]) == ("checkpoint_save", 6)
    assert report["action"] == "stopping the run"
    assert "write_that_hangs_until_reported" in report["stacks"]["trainer"]
