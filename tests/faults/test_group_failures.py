"""A prompt over `max_model_len` and an environment whose `reset` raises cost only their group:
dropped, recorded as consumed, counted, with a warning naming the row and the fix. A run where
every group fails so stops after `GROUP_FAILURE_WINDOW` in a row with the last error."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.environments import EnvironmentResetError
from grpo_agent.rollout.group_failures import (
    ENV_ERROR,
    PROMPT_TOO_LONG,
    GroupFailureError,
    GroupFailureTracker,
    failure_reason,
)
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker, RolloutWorkerError
from grpo_agent.sampler.errors import RequestRejectedError
from grpo_agent.types import PromptConsumed, TrainingSample
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))  # the spawned worker imports fault_helpers too
from fault_helpers import FailsOnRow1Env, token_sum_reward

TOO_LONG = RequestRejectedError(
    "POST http://x/inference/v1/generate was rejected with HTTP 400: ...", status_code=400,
    server_message="The decoder prompt (length 3001) is longer than the maximum model length of 1024.")


def test_which_failures_cost_only_their_group():
    assert failure_reason(TOO_LONG) == PROMPT_TOO_LONG
    assert failure_reason(EnvironmentResetError("Env.reset() raised KeyError: 'x'")) == ENV_ERROR
    other_400 = RequestRejectedError("bad", status_code=400, server_message="temperature must be >= 0")
    assert failure_reason(other_400) is None  # a bug in the request: it stops the run
    routed_wrong = RequestRejectedError("gone", status_code=404,
                                        server_message="maximum model length")
    assert failure_reason(routed_wrong) is None  # only a 400 says the prompt itself is too long
    assert failure_reason(ValueError("maximum model length")) is None


def test_failed_groups_warn_once_and_stop_the_run_only_after_a_window_in_a_row(caplog):
    tracker = GroupFailureTracker(window=3)
    with caplog.at_level(logging.WARNING):
        tracker.failed(PROMPT_TOO_LONG, TOO_LONG, prompt_index=7, row_index=5)
        tracker.failed(PROMPT_TOO_LONG, TOO_LONG, prompt_index=8, row_index=6)
        tracker.succeeded()  # a group that trained: the streak starts over
        tracker.failed(PROMPT_TOO_LONG, TOO_LONG, prompt_index=9, row_index=7)
        tracker.failed(PROMPT_TOO_LONG, TOO_LONG, prompt_index=10, row_index=8)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "dataset row 5" in warnings[0] and "--max-model-len" in warnings[0]
    with pytest.raises(GroupFailureError, match=r"3 groups in a row failed.*dataset row 9.*max_model_len"):
        tracker.failed(PROMPT_TOO_LONG, TOO_LONG, prompt_index=11, row_index=9)



def test_a_too_long_prompt_is_recognised_in_any_of_the_servers_wordings():
    """vLLM's generate route says "maximum model length", its OpenAI routes "maximum context
    length"; case aside, and from the error's own text when the server sent no message."""
    for message in ("This model's maximum context length is 1024 tokens.",
                    "Prompt length exceeds the Maximum Model Length (1024)."):
        error = RequestRejectedError("rejected", status_code=400, server_message=message)
        assert failure_reason(error) == PROMPT_TOO_LONG, message
    bare = RequestRejectedError("HTTP 400: prompt over max_model_len", status_code=400)
    assert failure_reason(bare) == PROMPT_TOO_LONG


def test_an_environment_failure_warns_with_its_traceback_and_a_too_long_prompt_without(caplog):
    """A raising reset/get_reward is a bug to find in the user's code: its warning carries the
    traceback; a too-long prompt is the data's, and its traceback would be noise."""
    tracker = GroupFailureTracker(window=10)
    with caplog.at_level(logging.WARNING):
        for reason, error in ((ENV_ERROR, EnvironmentResetError("Env.reset() raised KeyError")),
                              (PROMPT_TOO_LONG, TOO_LONG)):
            try:  # as the engine calls it: while handling the error
                raise error
            except (EnvironmentResetError, RequestRejectedError):
                tracker.failed(reason, error, prompt_index=1, row_index=1)
    assert [bool(record.exc_info) for record in caplog.records] == [True, False]


def _worker(server, tmp_path, texts, **kwargs) -> RolloutWorker:
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), num_generations=2, max_completion_length=8,
        max_concurrent_rollouts=4, rollout_worker_timeout=60, report_to="none",
        vllm_server_base_url=server.base_url)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": text}], "row_id": i} for i, text in enumerate(texts)])
    return RolloutWorker(AsyncRolloutLoop, config=config, model_name=str(server.model_path),
                         dataset=dataset, reward_funcs=[token_sum_reward],
                         processing_class=AutoTokenizer.from_pretrained(server.model_path), **kwargs)


LONG = "count " * 3000  # far over the session server's max_model_len (1024)


@pytest.mark.vllm
def test_a_too_long_prompt_and_a_raising_reset_cost_only_their_groups(vllm_server, tmp_path):
    texts = [LONG, "play", *[f"go {i}" for i in range(2, 6)]]  # one epoch reaches rows 0 and 1 soon
    worker = _worker(vllm_server, tmp_path, texts, environment_factory=FailsOnRow1Env)
    reasons, samples = {}, 0
    with worker:
        deadline = time.monotonic() + 420  # the loaded CI box: minutes for a few groups
        while time.monotonic() < deadline and not ({0, 1} <= reasons.keys() and samples):
            for item in worker.pull(timeout=5):
                if isinstance(item, PromptConsumed):
                    reasons[item.row_index] = item.reason
                samples += isinstance(item, TrainingSample)
            worker.report_step_tokens(10_000)
        time.sleep(1.5)  # one metrics flush
        metrics = worker.drain_metrics()
    assert reasons.get(0) == PROMPT_TOO_LONG and reasons.get(1) == ENV_ERROR, reasons
    assert samples, "the other rows trained nothing"
    assert sum(v for k, v in metrics if k == "rollout/prompt_too_long_group_count") >= 1
    assert sum(v for k, v in metrics if k == "rollout/env_error_group_count") >= 1


@pytest.mark.vllm
def test_a_run_whose_every_prompt_is_too_long_stops_with_a_clear_error(vllm_server, tmp_path):
    worker = _worker(vllm_server, tmp_path, [LONG] * 30)
    with worker, pytest.raises(RolloutWorkerError) as raised:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            worker.pull(timeout=5)
            worker.report_step_tokens(10_000)
    message = str(raised.value)
    assert "10 groups in a row failed" in message and "--max-model-len" in message


def test_a_dropped_group_gives_back_the_slots_its_rollouts_never_took():
    """One rollout runs, one waits for a slot; the group is dropped: both slots are free again
    (a leaked promise per drop would shrink the dispatcher's room until nothing dispatches)."""
    import asyncio
    from types import SimpleNamespace

    from grpo_agent.rollout.concurrency import RolloutSlots
    from grpo_agent.rollout.engine import RolloutEngine
    from grpo_agent.rollout.unfinished import CallsSoFar

    async def hang(*args):
        await asyncio.sleep(3600)

    async def main():
        engine = RolloutEngine(SimpleNamespace(config=None, run_episode=hang), channels=None)
        engine.slots = RolloutSlots(SimpleNamespace(value=1))
        engine.slots.promise(2)
        took_slot = [0]
        slot = SimpleNamespace(row={}, row_index=0)
        rollouts = [asyncio.ensure_future(engine._run_rollout(slot, 0, took_slot, None, CallsSoFar()))
                    for _ in range(2)]
        await asyncio.sleep(0.2)
        assert took_slot == [1]
        await engine._cancel_group(rollouts, took_slot, 0)
        return engine.slots.in_flight, engine.slots.promised, engine.slots.can_dispatch()

    assert asyncio.run(main()) == (0, 0, True)
