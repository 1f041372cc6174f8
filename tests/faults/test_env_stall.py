"""An environment whose `reset` or `get_reward` hangs past its stage deadline, through the
rollout loop's `run_episode` and the real environment runner (only the model's turn is
scripted): the stall report names `env_reset` / `env_finish` and the row, and the rollout
ends with `StageStalled` for the loop to drop and count."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpo_agent import stall
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.rollout.environments import EnvironmentRunner
from grpo_agent.rollout.loop import AsyncRolloutLoop

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome

RELEASE = threading.Event()


class HangingEnv:
    """A game server that never answers at `hang_in` ("reset" or "get_reward")."""

    hang_in = "reset"

    def reset(self, **kwargs):
        if self.hang_in == "reset":
            RELEASE.wait(600)
        return "guess the word"

    def get_reward(self):
        RELEASE.wait(600)
        return 1.0


@pytest.mark.parametrize("stage", ["env_reset", "env_finish"])
def test_a_hung_environment_is_named_and_its_rollout_ends(tmp_path, monkeypatch, stage, record_property):
    monkeypatch.setattr(HangingEnv, "hang_in", "reset" if stage == "env_reset" else "get_reward")
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             stall_timeouts={stage: 1})
    watch = stall.StallWatch(config, "worker").start()
    executor = ThreadPoolExecutor(2)

    async def generate_one(prompt, tools, group_id):
        return SimpleNamespace(metrics={})

    loop = SimpleNamespace(env_runner=EnvironmentRunner(HangingEnv, executor), stalls=watch,
                           tools=[], generate_one=generate_one,
                           _without_images=lambda prompt, row_index: prompt)
    started = time.monotonic()  # the episode's reset, or its reward right after, hangs
    try:
        with pytest.raises(stall.StageStalled, match=f"stage '{stage}' \\(row_index=7\\)"):
            asyncio.run(AsyncRolloutLoop.run_episode(loop, {"prompt": None}, 7, 0))
        record_fault_to_outcome(record_property, time.monotonic() - started, 1.0)
    finally:
        RELEASE.set()
        executor.shutdown(wait=False)
        watch.stop()
        RELEASE.clear()
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert (report["stage"], report["row_index"]) == (stage, 7)
    assert report["action"] == "cancelled and counted"
    hung = "reset" if stage == "env_reset" else "get_reward"
    assert f"in {hung}" in report["stacks"]["worker"] and "run_episode" in report["stage_stack"]
