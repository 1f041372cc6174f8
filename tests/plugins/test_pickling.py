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


UNGUARDED_SCRIPT = '''
import multiprocessing
from grpo_agent import AsyncGRPOTrainer, HarnessAsyncGRPOTrainer, agent

@agent("unguarded")
async def run(client, row):
    return 1.0

for build in (lambda: HarnessAsyncGRPOTrainer(model="/no/such/model", agent=run),
              lambda: AsyncGRPOTrainer(model="/no/such/model")):
    try:
        build()
    except Exception as err:
        print(f"{__name__}: {type(err).__name__}: {err}", flush=True)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=print, args=("child ran",))
    child.start()
    child.join()
'''


def test_a_script_that_trains_at_top_level_is_told_to_add_the_main_guard(tmp_path):
    """docs/harness.md's agent example as a script without `if __name__ == "__main__":`: the
    spawned worker re-runs the script, whose trainer used to fail there with "Cannot pickle
    agent = run ... define them at module level" (it was at module level)."""
    import subprocess
    import sys

    script = tmp_path / "train_agent.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    child = [line for line in done.stdout.splitlines() if line.startswith("__mp_main__:")]
    assert len(child) == 2, done.stdout + done.stderr
    for line, name in zip(child, ("HarnessAsyncGRPOTrainer", "AsyncGRPOTrainer")):
        assert line.startswith(f"__mp_main__: RuntimeError: {name} is being built while a spawned "
                               "process re-imports your main script"), line
        assert 'if __name__ == "__main__":' in line
    parent = [line for line in done.stdout.splitlines() if line.startswith("__main__:")]
    assert len(parent) == 2 and not any("spawned process" in line for line in parent), done.stdout
    assert "child ran" in done.stdout
