"""An environment whose `reset` raises or returns the wrong type.

A raising reset is wrapped in `EnvironmentResetError` naming the env class and the error: it
costs its group only (tests/faults/test_group_failures.py shows the real worker). A reset of the
wrong type is a bug in the env: a clear error naming it. The instance is not lost either way.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpo_agent.rollout.environments import EnvironmentResetError, EnvironmentRunner


class RaisingEnv:
    def reset(self, **kwargs):
        raise ConnectionError("game server refused the connection")


class NumberEnv:
    def reset(self, **kwargs):
        return 42


class MessagesEnv:
    def reset(self, **kwargs):
        return [{"role": "user", "content": "hi"}]


def test_a_raising_reset_is_named_and_the_instance_goes_back_to_the_pool():
    runner = EnvironmentRunner(RaisingEnv, ThreadPoolExecutor(2))
    with pytest.raises(EnvironmentResetError,
                       match=r"RaisingEnv.reset\(\) raised ConnectionError: game server refused") as raised:
        asyncio.run(runner.start({"prompt": "play"}))
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert len(runner._idle["RaisingEnv"]) == 1


@pytest.mark.parametrize("factory, returned", [(NumberEnv, "int"), (MessagesEnv, "list")])
def test_a_reset_of_the_wrong_type_is_named(factory, returned):
    runner = EnvironmentRunner(factory, ThreadPoolExecutor(2))
    with pytest.raises(TypeError, match=rf"{factory.__name__}.reset\(\) returned {returned} .*must return the task text"):
        asyncio.run(runner.start({"prompt": "play"}))
    assert len(runner._idle[factory.__name__]) == 1
