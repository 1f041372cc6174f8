"""The vLLM server dies mid-run: the worker retries (counted), then drops its groups in flight
as `server_lost` (recorded as consumed, counted), raises `server_down` and dispatches nothing
until the trainer says the server is back (`sampler.recovery`); then it goes on.

Uses its own server (never the shared session server), so it is slow: marked `slow`. The whole
restart through the trainer is tests/faults/test_server_restart.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import rollout_test_helpers as helpers
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker
from grpo_agent.types import PromptConsumed, TrainingSample
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "faults"))
from fault_helpers import record_fault_to_outcome

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _pull_until(worker, done, seconds: float) -> list:
    items, deadline = [], time.monotonic() + seconds
    while not done(items) and time.monotonic() < deadline:
        items += worker.pull(timeout=2)
        worker.report_step_tokens(10_000)
    return items


def test_a_server_killed_mid_run_costs_its_groups_in_flight_and_the_worker_waits(tiny_model_path, tmp_path,
                                                                                 record_property):
    from grpo_agent.sampler.server import ManagedVLLMServer

    server = ManagedVLLMServer(tiny_model_path, max_model_len=512, weight_transfer_backend=None,
                               log_path=tmp_path / "server.log").start()
    try:
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path), num_generations=4, max_completion_length=64,
            max_concurrent_rollouts=8, vllm_server_base_url=server.base_url, report_to="none",
            rollout_worker_timeout=60)
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(400)])
        worker = RolloutWorker(AsyncRolloutLoop, config=config, model_name=str(tiny_model_path),
                               dataset=dataset, reward_funcs=[helpers.token_sum_reward],
                               processing_class=AutoTokenizer.from_pretrained(tiny_model_path))
        with worker:
            def has_sample(items):
                return any(isinstance(i, TrainingSample) for i in items)

            assert has_sample(_pull_until(worker, has_sample, 120)), "nothing before the kill"
            killed = time.monotonic()  # before stop(): SIGTERM, SIGKILL after a grace period
            server.stop()
            lost = _pull_until(worker, lambda items: worker.server_down, 120)  # raises if it died
            # The outcome: the worker has dropped its groups in flight and says it waits.
            record_fault_to_outcome(record_property, time.monotonic() - killed, config.vllm_server_timeout)
            assert worker.server_down, "the worker never said it lost the server"
            lost += _pull_until(worker, lambda items: False, 15)  # nothing new is dispatched
            notices = [i for i in lost if isinstance(i, PromptConsumed) and i.reason == "server_lost"]
            assert notices, f"no group in flight was recorded as lost: {lost}"
            assert len(notices) <= config.max_concurrent_rollouts, "it kept dispatching"
            server.restart()
            worker.server_restored()
            assert has_sample(_pull_until(worker, has_sample, 120)), "nothing after the restart"
            metrics = worker.drain_metrics()
    finally:
        server.stop()
    assert sum(v for k, v in metrics if k == "rollout/vllm_retry_count") > 0
    assert sum(v for k, v in metrics if k == "rollout/server_lost_group_count") >= 1
