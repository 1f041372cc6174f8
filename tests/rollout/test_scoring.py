"""Scoring a group: concurrent reward functions, None handling, contract errors, isolation."""
from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from grpo_agent.advantages import group_norm
from grpo_agent.rollout.scoring import (
    RewardFailureTracker,
    RewardFunctionError,
    add_rollout_sources,
    has_signal,
    run_reward_functions,
)
from grpo_agent.types import RolloutGroup


class Arena:
    pass


def _group(size: int = 4, **columns) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * size,
        reward_kwargs={k: [v] * size for k, v in columns.items()},
        completions=[[{"role": "assistant", "content": "a" * (i + 1)}] for i in range(size)],
        completions_ids=[[7] * (i + 1) for i in range(size)], completions_sequences=[[]] * size,
        tool_call_counts=[0] * size, tool_failure_counts=[0] * size, model_version=0, group_id=0,
        row_index=0, env_rewards=[None] * size, rollout_rewards=[None] * size)


def _score(funcs, group):
    async def go():
        with ThreadPoolExecutor(4) as executor:
            return await run_reward_functions(funcs, group, executor)
    return asyncio.run(go())


def test_reward_functions_get_prompts_completions_ids_and_every_column_but_prompt():
    seen = {}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.update(kwargs, prompts=prompts, ids=completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    scores, failure = _score({"spy": spy}, _group(3, answer="42"))
    assert failure is None
    assert seen["answer"] == ["42"] * 3 and "prompt" not in seen and len(seen["prompts"]) == 3
    assert scores.by_source["spy"].tolist() == [1.0, 2.0, 3.0]


def test_sync_and_async_rewards_run_concurrently():
    async_started = threading.Event()

    async def slow_async(completions, **kwargs):
        async_started.set()
        await asyncio.sleep(0.2)
        return [1.0] * len(completions)

    def waits_for_async(completions, **kwargs):
        # Deadlocks (and fails) if the sync function ran before or after the async one.
        assert async_started.wait(timeout=5), "the async reward was not running concurrently"
        return [0.5] * len(completions)

    scores, failure = _score({"a": slow_async, "s": waits_for_async}, _group(2))
    assert failure is None
    assert scores.total(2).tolist() == [1.5, 1.5]


class Judge:
    """A reward as an object with an async `__call__` (a judge model's client kept on it)."""

    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c[0]["content"])) for c in completions]


def test_an_object_whose_call_is_async_is_awaited():
    # Run in the executor like a sync function, it would return a coroutine, refused as
    # "returned coroutine": every group's reward failed.
    scores, failure = _score({"judge": Judge()}, _group(2))
    assert failure is None
    assert scores.by_source["judge"].tolist() == [1.0, 2.0]


def test_none_drops_out_of_one_source_and_an_unscored_rollout_is_nan():
    def math_reward(completions, **kwargs):
        return [1.0, None, None, 0.0]

    def code_reward(completions, **kwargs):
        return [None, 2.0, None, None]

    scores, _ = _score({"math": math_reward, "code": code_reward}, _group(4))
    total = scores.total(4)
    assert total[[0, 1, 3]].tolist() == [1.0, 2.0, 0.0] and math.isnan(total[2])
    advantages = group_norm(SimpleNamespace(rewards=total))
    assert advantages[2] == 0.0
    assert abs(advantages.sum()) < 1e-9
    scored = total[~np.isnan(total)]
    assert np.allclose(advantages[[0, 1, 3]], (scored - scored.mean()) / scored.std())


@pytest.mark.parametrize("result, problem", [
    ([1.0, 2.0], "returned 2 rewards for 4 completions"),
    # one too many: the extra reward would shift the group's advantages onto other rollouts
    ([1.0, 2.0, 3.0, 4.0, 5.0], "returned 5 rewards for 4 completions"),
    ("1111", "returned str"),
    ([1.0, "x", 0.0, 0.0], "returned a str"),
    ([True, 1.0, 0.0, 0.0], "returned a bool"),
    ([1.0, math.nan, 0.0, 0.0], "returned nan for completion 1"),
    ([1.0, 0.0, 0.0, -math.inf], "returned -inf for completion 3"),
])
def test_a_reward_with_the_wrong_shape_or_type_stops_the_run_naming_it(result, problem):
    def broken(**kwargs):
        return result

    with pytest.raises(RewardFunctionError, match=f"'broken' {problem}"):
        _score({"broken": broken}, _group(4))


def test_a_raising_reward_costs_its_group_and_stops_only_when_it_keeps_failing(caplog):
    def flaky(**kwargs):
        raise ConnectionError("judge unavailable")

    def fine(completions, **kwargs):
        return [1.0] * len(completions)

    _scores, failure = _score({"flaky": flaky, "fine": fine}, _group(2))
    assert failure.name == "flaky" and "ConnectionError: judge unavailable" in failure.traceback
    tracker = RewardFailureTracker(window=3)
    tracker.record(["flaky", "fine"], failure)
    tracker.record(["flaky", "fine"], None)  # a success resets the streak
    tracker.record(["flaky", "fine"], failure)
    tracker.record(["flaky", "fine"], failure)
    assert caplog.text.count("Reward function 'flaky' raised") == 1, "only the first traceback is logged"
    with pytest.raises(RewardFunctionError, match="'flaky' raised on 3 groups in a row"):
        tracker.record(["flaky", "fine"], failure)


def test_a_reward_that_keeps_raising_is_named_on_the_one_line_a_failed_run_prints(tmp_path):
    """The CLI shows the last line of the worker's traceback: it must be the stopping error,
    naming the reward and its exception (it once was the exception's own line only)."""
    import traceback

    from grpo_agent.cli.failure import report_failure
    from grpo_agent.rollout.worker import RolloutWorkerError

    def judge(**kwargs):
        raise KeyError("verdict")

    _scores, failure = _score({"judge": judge}, _group(2))
    tracker = RewardFailureTracker(window=2)
    tracker.record(["judge"], failure)
    try:
        tracker.record(["judge"], failure)
    except RewardFunctionError:
        worker_traceback = traceback.format_exc()  # what the rollout worker sends the trainer
    assert "KeyError: 'verdict'" in worker_traceback.split("direct cause")[0], "chained to the cause"
    message, _code = report_failure(RolloutWorkerError(f"The rollout worker failed:\n{worker_traceback}"),
                                    tmp_path)
    first = message.splitlines()[0]
    assert "failed: RewardFunctionError: Reward function 'judge' raised on 2 groups in a row" in first, \
        "named by its class, without the module path that crowded the 300-character line"
    assert "KeyError: 'verdict'" in first and "Fix it" in first


def test_the_first_raising_reward_is_reported_and_a_cancellation_is_not_swallowed():
    """Two reward functions raise: the failure names the first in reward_funcs' order (the
    one the streak counts). A BaseException that is not an Exception (a cancellation) stops
    scoring as raised instead of becoming the group's reward failure."""
    def judge(**kwargs):
        raise ConnectionError("judge unavailable")

    def parser(**kwargs):
        raise ValueError("no answer tag")

    _scores, failure = _score({"judge": judge, "parser": parser}, _group(2))
    assert failure.name == "judge" and "ConnectionError" in failure.traceback

    async def cancelled(**kwargs):
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        _score({"judge": judge, "cancelled": cancelled}, _group(2))


def test_environment_and_rollout_rewards_are_summed_in_as_their_own_sources():
    group = _group(3)
    group.env_rewards = [(Arena, 1.0), (Arena, 0.0), None]
    group.rollout_rewards = [0.5, None, None]
    scores, _ = _score({}, group)
    add_rollout_sources(scores, group)
    assert set(scores.by_source) == {"Arena", "rollout"}
    total = scores.total(3)
    assert total[:2].tolist() == [1.5, 0.0] and math.isnan(total[2])


def test_groups_without_signal_are_recognised():
    assert not has_signal(np.array([1.0, 1.0, 1.0]))
    assert not has_signal(np.array([1.0, np.nan, np.nan]))
    assert not has_signal(np.array([np.nan, np.nan]))
    assert has_signal(np.array([1.0, np.nan, 0.0]))
    assert group_norm(SimpleNamespace(rewards=np.array([2.0, 2.0]))).tolist() == [0.0, 0.0]


def _by_name(observations):
    named = {}
    for name, value in observations:
        named.setdefault(name, []).append(value)
    return named


def test_reward_observations_follow_the_spec_metrics():
    """The spec's reward metrics of one kept and one dropped group: `reward_group_std` is the
    std the advantages are divided by (population, over scored rollouts) and, as
    `rewards/{name}/group_std`, is averaged over training samples (one observation per sample);
    `frac_reward_zero_std` is 1 for a dropped group; `reward_dropped` and the per-source means
    leave unscored rollouts out."""
    from grpo_agent.rollout.observations import reward_observations
    from grpo_agent.rollout.scoring import GroupScores

    scores = GroupScores()
    scores.by_source.update(a=np.array([1.0, 0.0, np.nan, 1.0]), b=np.array([0.5, 0.5, np.nan, np.nan]))
    rewards = scores.total(4)  # 1.5, 0.5, unscored, 1.0
    kept = _by_name(reward_observations(scores, rewards, [2, 1, 0, 1], kept=True))
    std_a, std = np.std([1.0, 0.0, 1.0]), np.std([1.5, 0.5, 1.0])
    assert kept.keys() == {"frac_reward_zero_std", "reward", "rewards/a/mean", "rewards/a/group_std",
                           "rewards/b/mean", "rewards/b/group_std", "reward_group_std", "reward_kept"}
    assert kept["frac_reward_zero_std"] == [0.0]
    assert kept["reward"] == [1.5, 0.5, 1.0]
    assert kept["rewards/a/mean"] == [1.0, 0.0, 1.0] and kept["rewards/b/mean"] == [0.5, 0.5]
    np.testing.assert_allclose(kept["rewards/a/group_std"], [std_a] * 4)
    assert kept["rewards/b/group_std"] == [0.0] * 4
    np.testing.assert_allclose(kept["reward_group_std"], [std] * 4)
    assert kept["reward_kept"] == [1.5, 1.5, 0.5, 1.0]

    scores = GroupScores()
    scores.by_source.update(a=np.array([1.0, 1.0, np.nan]))
    dropped = _by_name(reward_observations(scores, scores.total(3), [0, 0, 0], kept=False))
    assert dropped == {"frac_reward_zero_std": [1.0], "reward": [1.0, 1.0],
                       "rewards/a/mean": [1.0, 1.0], "reward_dropped": [1.0, 1.0]}
