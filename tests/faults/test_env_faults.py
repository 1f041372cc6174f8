"""An environment whose `reset` raises or returns the wrong type: a clear error naming it.

The engine treats an exception out of a rollout as fatal (the worker stops and the trainer's
next pull raises `RolloutWorkerError` with the traceback, as tests/rollout/test_worker_vllm.py
shows for rewards); these tests pin what that error says and that the instance is not lost.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpo_agent.rollout.environments import EnvironmentRunner


class RaisingEnv:
    def reset(self, **kwargs):
        raise ConnectionError("game server refused the connection")


class NumberEnv:
    def reset(self, **kwargs):
        return 42


class MessagesEnv:
    def reset(self, **kwargs):
        return [{"role": "user", "content": "hi"}]


def test_a_raising_reset_propagates_and_the_instance_goes_back_to_the_pool():
    runner = EnvironmentRunner(RaisingEnv, ThreadPoolExecutor(2))
    with pytest.raises(ConnectionError, match="game server refused"):
        asyncio.run(runner.start({"prompt": "play"}))
    assert len(runner._idle["RaisingEnv"]) == 1


@pytest.mark.parametrize("factory, returned", [(NumberEnv, "int"), (MessagesEnv, "list")])
def test_a_reset_of_the_wrong_type_is_named(factory, returned):
    runner = EnvironmentRunner(factory, ThreadPoolExecutor(2))
    with pytest.raises(TypeError, match=rf"{factory.__name__}.reset\(\) returned {returned} .*must return the task text"):
        asyncio.run(runner.start({"prompt": "play"}))
    assert len(runner._idle[factory.__name__]) == 1
