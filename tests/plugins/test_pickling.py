"""The spec's rule: objects for the rollout worker must pickle, checked before anything starts."""
from __future__ import annotations

import pytest
from grpo_agent.plugins import check_picklable
from grpo_agent.rewards import accuracy_reward


def make_closure():
    offset = 1.0

    def shifted_reward(completions, **kwargs):
        return [offset] * len(completions)

    return shifted_reward


def test_module_level_objects_pass():
    check_picklable({"reward_funcs": [accuracy_reward], "tools": [], "environment_factory": None})


def test_lambdas_closures_and_local_classes_are_named():
    class LocalEnv:
        def reset(self, **row):
            return None

    with pytest.raises(TypeError) as err:
        check_picklable({
            "reward_funcs": [accuracy_reward, lambda completions, **kw: [0.0], make_closure()],
            "environment_factory": {"local": LocalEnv},
        })
    message = str(err.value)
    assert message.startswith(
        "Cannot pickle reward_funcs[1] = test_lambdas_closures_and_local_classes_are_named.<locals>.<lambda>")
    assert "reward_funcs[2] = make_closure.<locals>.shifted_reward" in message
    assert "environment_factory['local'] = " in message and "LocalEnv" in message
    assert "reward_funcs[0]" not in message
    assert "define them at module level" in message


def test_objects_inside_tuples_are_named_by_position():
    with pytest.raises(TypeError, match=r"^Cannot pickle reward_funcs\[1\] = make_closure.<locals>.shifted_reward"):
        check_picklable({"reward_funcs": (accuracy_reward, make_closure())})
