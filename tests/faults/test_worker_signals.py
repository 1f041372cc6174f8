"""The rollout worker frozen with SIGSTOP (a hang, not a death) against the real vLLM server:
the trainer's next pull names it within rollout_worker_timeout, and stopping it leaves no
process behind. (SIGKILL: tests/rollout/test_worker_vllm.py.)"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker, RolloutWorkerError
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))  # the spawned worker imports the reward by module name
import fault_helpers

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_frozen_worker_is_named_by_the_next_pull_and_stopped(vllm_server, tmp_path, record_property):
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), num_generations=2, max_completion_length=8, max_concurrent_rollouts=2,
        vllm_server_base_url=vllm_server.base_url, report_to="none", use_cpu=True, rollout_worker_timeout=4)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(16)])
    worker = RolloutWorker(AsyncRolloutLoop, config=config, model_name=str(vllm_server.model_path),
                           dataset=dataset, reward_funcs=[fault_helpers.token_sum_reward],
                           processing_class=AutoTokenizer.from_pretrained(vllm_server.model_path))
    worker.start()
    pid = worker.pid
    try:
        deadline = time.monotonic() + 120
        while not worker.pull(timeout=1.0):  # running: it produced something
            worker.report_step_tokens(10_000)
            assert time.monotonic() < deadline, "the worker produced nothing in 120 s"
        frozen_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RolloutWorkerError, match=r"no heartbeat for \d+ s \(rollout_worker_timeout=4"):
            try:
                while True:
                    worker.pull(timeout=1.0)
                    worker.report_step_tokens(10_000)
            finally:  # the outcome: the pull that names the frozen worker
                fault_helpers.record_fault_to_outcome(record_property, time.monotonic() - frozen_at,
                                                      config.rollout_worker_timeout)
    finally:
        worker.stop()
    assert _gone(pid)
    # Ended by the pull's SIGTERM, which a stopped process acts on only once continued; a
    # SIGKILL here means stop() waited its whole join first.
    assert worker._process.exitcode == -signal.SIGTERM
