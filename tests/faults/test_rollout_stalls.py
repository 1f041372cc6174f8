"""Rollout stalls against the real vLLM server: a reward that hangs, and the server frozen
with SIGSTOP (a hang, not a death). Each stalled group is reported in stall_report.json with
the worker's stacks, dropped and counted, and the worker goes on producing samples."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig, stall
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker
from grpo_agent.types import PromptConsumed, TrainingSample
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))  # the spawned worker imports fault_helpers too
import fault_helpers

pytestmark = pytest.mark.vllm
SCORING_S = GENERATE_S = 3  # the stage deadlines the two cases set (stall_timeouts)


def _worker(server, tmp_path, reward, **config):
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), num_generations=2, max_completion_length=16,
        max_concurrent_rollouts=4, vllm_server_base_url=server.base_url, report_to="none",
        use_cpu=True, **config)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"go {i}"}], "row_id": i} for i in range(64)])
    return RolloutWorker(AsyncRolloutLoop, config=config, model_name=str(server.model_path),
                         dataset=dataset, reward_funcs=[reward],
                         processing_class=AutoTokenizer.from_pretrained(server.model_path))


def _pull_until(worker, done, limit_s):
    """Pull (opening the allowance) until `done(items so far)`; returns the items."""
    items: list = []
    deadline = time.monotonic() + limit_s
    while not done(items) and time.monotonic() < deadline:
        items += worker.pull(timeout=1.0)
        worker.report_step_tokens(10_000)
    return items


def _stalled(items):
    return [i for i in items if isinstance(i, PromptConsumed) and i.reason == "stalled"]


def _samples(items):
    return [i for i in items if isinstance(i, TrainingSample)]


def test_a_hanging_reward_is_reported_dropped_and_counted(vllm_server, tmp_path, monkeypatch, record_property):
    started_file = tmp_path / "fault_started"  # the reward writes when it starts hanging
    monkeypatch.setenv(fault_helpers.FAULT_STARTED_ENV, str(started_file))  # the spawned worker inherits it
    worker = _worker(vllm_server, tmp_path, fault_helpers.hangs_on_row_3,
                     stall_timeouts={"scoring": SCORING_S})
    dropped_at: list[float] = []  # when this side first sees the stalled group dropped

    def done(got):
        if _stalled(got) and not dropped_at:
            dropped_at.append(time.time())
        return bool(dropped_at) and len(_samples(got)) >= 4

    worker.start()
    try:
        items = _pull_until(worker, done, 150)
    finally:
        worker.stop(grace_s=2.0)  # the hung reward's thread would keep a polite exit waiting
    if dropped_at:
        fault_helpers.record_fault_to_outcome(
            record_property, dropped_at[0] - fault_helpers.fault_started_at(started_file), SCORING_S)
    metrics = worker.drain_metrics()  # stop() collected the worker's last batch
    assert [i.row_index for i in _stalled(items)] == [3]
    assert len(_samples(items)) >= 4, "the worker stopped producing after the stall"
    assert sum(v for k, v in metrics if k == "rollout/stalled_group_count") == 1
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["role"] == "worker" and report["stage"] == "scoring" and report["row_index"] == 3
    assert report["rewards"] == ["hangs_on_row_3"] and report["elapsed_s"] >= 3
    assert "hangs_on_row_3" in report["stacks"]["worker"]  # the culprit's frame
    assert report["context"]["server"] == vllm_server.base_url


def test_a_frozen_server_stalls_generation_then_the_worker_recovers(vllm_server, tmp_path, record_property):
    if not getattr(vllm_server, "pid", None):
        pytest.skip("needs the managed test server's pid to freeze it")
    worker = _worker(vllm_server, tmp_path, fault_helpers.token_sum_reward,
                     stall_timeouts={"vllm_generate": GENERATE_S})
    worker.start()
    try:
        _pull_until(worker, lambda got: len(_samples(got)) >= 2, 120)  # warm: it works
        frozen_at = time.monotonic()
        os.kill(vllm_server.pid, signal.SIGSTOP)
        try:
            frozen = _pull_until(worker, _stalled, 60)
            # The outcome: a stalled group reported and dropped (then SIGCONT, and it goes on).
            fault_helpers.record_fault_to_outcome(record_property, time.monotonic() - frozen_at, GENERATE_S)
        finally:
            os.kill(vllm_server.pid, signal.SIGCONT)
        after = _pull_until(worker, lambda got: len(_samples(got)) >= 2, 120)
    finally:
        worker.stop()
    assert _stalled(frozen), "no group was dropped while the server was frozen"
    assert len(_samples(after)) >= 2, "the worker did not recover once the server came back"
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == "vllm_generate" and report["elapsed_s"] >= 3
    assert any(s["stage"] == "vllm_generate" for s in report["in_flight"])
    assert "generate_one_turn" in report["stage_stack"]  # the stuck rollout's await chain
