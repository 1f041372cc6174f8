"""The vLLM server dies mid-run: the worker retries (counted), then fails with a clear error.

Uses its own server (never the shared session server), so it is slow: marked `slow`.
"""
from __future__ import annotations

import time

import pytest
import rollout_test_helpers as helpers
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker, RolloutWorkerError
from grpo_agent.types import TrainingSample
from transformers import AutoTokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_server_killed_mid_run_is_retried_then_reported(tiny_model_path, tmp_path):
    from grpo_agent.sampler.server import ManagedVLLMServer

    server = ManagedVLLMServer(tiny_model_path, max_model_len=512, weight_transfer_backend=None,
                               log_path=tmp_path / "server.log").start()
    try:
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path), num_generations=4, max_completion_length=64,
            max_concurrent_rollouts=8, vllm_server_base_url=server.base_url, report_to="none",
            rollout_worker_timeout=60)
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(8)])
        worker = RolloutWorker(AsyncRolloutLoop, config=config, model_name=str(tiny_model_path),
                               dataset=dataset, reward_funcs=[helpers.token_sum_reward],
                               processing_class=AutoTokenizer.from_pretrained(tiny_model_path))
        with worker:
            got_sample = False
            deadline = time.monotonic() + 120
            while not got_sample and time.monotonic() < deadline:
                items = worker.pull(timeout=5)
                got_sample = any(isinstance(i, TrainingSample) for i in items)
                worker.report_step_tokens(10_000)
            assert got_sample, "the worker produced nothing before the server was stopped"
            server.stop()
            started = time.monotonic()
            with pytest.raises(RolloutWorkerError) as raised:
                while time.monotonic() - started < 120:
                    worker.pull(timeout=5)
                    worker.report_step_tokens(10_000)
            retries = sum(v for k, v in worker.drain_metrics() if k == "rollout/vllm_retry_count")
    finally:
        server.stop()
    message = str(raised.value)
    assert "The rollout worker failed" in message
    assert "No vLLM server answered" in message or "failed after 6 attempts" in message
    assert retries > 0
