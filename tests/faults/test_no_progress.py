"""The no-progress stall through the real trainer, worker and vLLM server: a reward that never
varies drops every group, so no step ever comes; the run names the cause and stops after
`no_progress_timeout` instead of waiting for epochs that would take hours."""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer, stall
from grpo_agent.train.no_progress import NO_PROGRESS_WINDOW_GROUPS

sys.path.insert(0, str(Path(__file__).parent))  # the spawned worker imports fault_helpers too
from fault_helpers import (
    FAULT_STARTED_ENV,
    constant_reward,
    fault_started_at,
    record_fault_to_outcome,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


def test_a_run_whose_groups_are_all_dropped_says_why_then_stops(trained_server, tmp_path, caplog, monkeypatch,
                                                                 record_property):
    started_file = tmp_path / "fault_started"  # the reward's first call: the first group dropped
    monkeypatch.setenv(FAULT_STARTED_ENV, str(started_file))  # the spawned worker inherits it
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(64)])
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), vllm_server_base_url=trained_server.base_url, num_generations=2,
        max_completion_length=8, token_budget=256, max_steps=5, num_train_epochs=1000,
        save_strategy="no", report_to="none", use_cpu=True, no_progress_timeout=8)
    trainer = AsyncGRPOTrainer(model=str(trained_server.model_path), reward_funcs=constant_reward,
                               train_dataset=dataset, args=args)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(stall.StageStalled) as raised:
        trainer.train()
    stopped_at = time.time()
    elapsed = time.monotonic() - started
    record_fault_to_outcome(record_property, stopped_at - fault_started_at(started_file, 0),
                            args.no_progress_timeout)
    print(f"no-progress stop after {elapsed:.1f} s (no_progress_timeout=8)")
    message = str(raised.value)
    assert "never produces reward variance" in message and "no_progress_timeout=8 s" in message
    # The early warning, once a window of groups was dropped (a pull may bring several at once).
    warned = re.search(r"No progress: the last (\d+) groups were all dropped", caplog.text)
    assert warned and int(warned.group(1)) >= NO_PROGRESS_WINDOW_GROUPS, caplog.text
    assert trainer.state.global_step == 0
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["role"] == "trainer" and report["stage"] == "no_progress"
    assert report["dropped_groups"]["zero_std"] >= NO_PROGRESS_WINDOW_GROUPS
    assert report["elapsed_s"] >= 8 and "worker" in report["stacks"]
    assert report["context"]["sample_queue_size"] is not None
