"""EnvironmentRunner with the spec's environments: pooling, routing, prompts, tools, rewards."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from grpo_agent.rollout.agent import execute_tool_call, run_tool_loop
from grpo_agent.rollout.concurrency import RolloutThreadPool
from grpo_agent.rollout.environments import EnvironmentRunner, build_prompt
from grpo_agent.rollout.tool_calls import ToolCall


class IncrementEnv:  # the spec's example, as written
    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class CodingEnv:
    def reset(self, **kwargs) -> str:
        self.kwargs = kwargs
        return "Compute the 5th Fibonacci number."

    def run_code(self, code: str) -> str:
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return "5"


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        return f"moved {action}"


class SlowEnv:
    def reset(self, **kwargs) -> None:
        time.sleep(0.3)

    async def get_reward(self) -> float:
        return 0.5


@pytest.fixture
def executor():
    with ThreadPoolExecutor(4) as pool:
        yield pool


def test_increment_env_prompt_tools_reward_and_pool_reuse(executor):
    runner = EnvironmentRunner(IncrementEnv, executor)

    async def two_rollouts():
        episode = await runner.start({})
        assert episode.prompt == [{"role": "user", "content": f"Increment the counter by {episode.env.target}."}]
        assert [t.__name__ for t in episode.tools] == ["increment"]
        episode.tools[0](episode.env.target)
        first = await runner.finish(episode)
        second_episode = await runner.start({})
        return episode, first, second_episode

    episode, reward, again = asyncio.run(two_rollouts())
    assert reward == (IncrementEnv, 1.0)
    assert again.env is episode.env and again.env.counter == 0  # reused, reset in between
    assert episode.metrics["env/reset_s"][0] >= 0 and "env/reward_s" in episode.metrics
    assert episode.metrics["env/late_call_unscored_count"] == [0.0]


def test_dict_factory_routes_by_environment_column_without_forwarding_it(executor):
    runner = EnvironmentRunner({"coding": CodingEnv, "game": GameEnv}, executor)

    async def start_both():
        return await runner.start({"environment": "coding", "level": 2}), await runner.start({"environment": "game"})

    coding, game = asyncio.run(start_both())
    assert [t.__name__ for t in coding.tools] == ["run_code"]
    assert [t.__name__ for t in game.tools] == ["move"]
    assert coding.env.kwargs == {"level": 2}
    assert asyncio.run(runner.finish(game)) is None  # GameEnv has no get_reward
    with pytest.raises(KeyError, match="'chess', which is not in environment_factory"):
        asyncio.run(runner.start({"environment": "chess"}))
    with pytest.raises(KeyError, match="no 'environment' column"):
        asyncio.run(runner.start({}))


def test_reset_text_is_appended_to_the_last_user_message_or_becomes_the_prompt():
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi."}]}
    assert build_prompt(row, "Target 3.")[-1] == {"role": "user", "content": "Hi.\n\nTarget 3."}
    assert row["prompt"][-1]["content"] == "Hi."  # the dataset row is not mutated
    assert build_prompt({"prompt": "Plain"}, None) == [{"role": "user", "content": "Plain"}]
    with pytest.raises(ValueError, match="reset\\(\\) returned None"):
        build_prompt({}, None)



def test_reset_text_goes_to_the_last_user_turn_of_a_conversation():
    """After an assistant turn it still joins the last *user* message; an empty user message
    becomes the reset text alone; a prompt without a user turn gets one appended."""
    row = {"prompt": [{"role": "user", "content": "First."}, {"role": "user", "content": "Then."},
                      {"role": "assistant", "content": "Ok."}]}
    assert [m["content"] for m in build_prompt(row, "Task.")] == ["First.", "Then.\n\nTask.", "Ok."]
    assert build_prompt({"prompt": [{"role": "user", "content": ""}]}, "Task.") == [
        {"role": "user", "content": "Task."}]
    assert build_prompt({"prompt": [{"role": "system", "content": "s"}]}, "Task.") == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "Task."}]


def test_slow_reset_runs_in_the_thread_pool_and_does_not_block_other_rollouts(executor):
    runner = EnvironmentRunner(SlowEnv, executor)

    async def concurrently():
        ticks = []

        async def ticker():
            for _ in range(5):
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.02)

        started = time.perf_counter()
        episodes = await asyncio.gather(*(runner.start({"prompt": "p"}) for _ in range(3)), ticker())
        return episodes[:3], ticks, time.perf_counter() - started

    episodes, ticks, elapsed = asyncio.run(concurrently())
    assert elapsed < 0.8  # three 0.3 s resets overlapped
    assert ticks[-1] - ticks[0] < 0.25  # the event loop kept running meanwhile
    assert asyncio.run(runner.finish(episodes[0])) == (SlowEnv, 0.5)  # async get_reward


class AbstainingEnv:
    def reset(self, **kwargs) -> str:
        return "Say anything."

    def get_reward(self) -> None:
        return None  # this episode is not this env's to score


def test_get_reward_returning_none_leaves_the_rollout_unscored(executor):
    """None from `get_reward` is NaN (unscored: no advantage, outside the group's mean and
    std), not a reward of 0.0, and the env still goes back to its pool."""
    import math

    runner = EnvironmentRunner(AbstainingEnv, executor)

    async def one_rollout():
        episode = await runner.start({})
        return episode, await runner.finish(episode), await runner.start({})

    episode, reward, again = asyncio.run(one_rollout())
    env_cls, value = reward
    assert env_cls is AbstainingEnv and math.isnan(value)
    assert again.env is episode.env


class BadRewardEnv:
    value = None

    def reset(self, **kwargs) -> str:
        return "Say anything."

    def get_reward(self):
        return self.value


@pytest.mark.parametrize(("value", "problem"), [
    (float("nan"), r"returned nan; rewards must be finite: return None"),
    (float("inf"), r"returned inf; rewards must be finite"),
    ("1.0", r"returned a str \('1.0'\) as a reward; each reward must be a float or None"),
])
def test_get_reward_returning_nan_or_a_non_number_stops_the_run_naming_it(executor, value, problem):
    """A NaN from `get_reward` was silently read as unscored (a reward function's NaN stops the
    run), inf made the group's advantages NaN, and a str ended the worker with float()'s
    ValueError, which named neither the env nor get_reward. Same rule as reward functions now;
    the env still goes back to its pool."""
    from grpo_agent.rollout.scoring import RewardFunctionError

    runner = EnvironmentRunner(type("BadRewardEnv", (BadRewardEnv,), {"value": value}), executor)

    async def one_rollout():
        episode = await runner.start({})
        with pytest.raises(RewardFunctionError, match=r"^BadRewardEnv\.get_reward\(\) " + problem):
            await runner.finish(episode)
        return episode, await runner.start({})

    episode, again = asyncio.run(one_rollout())
    assert again.env is episode.env


def test_environment_owned_data_requires_max_steps():
    from grpo_agent.train.trainer import _check_dataset  # the one home of the rule

    with pytest.raises(ValueError, match="Without a train_dataset the run length is unknown: "
                       "set max_steps > 0"):
        _check_dataset(None, IncrementEnv, SimpleNamespace(max_steps=-1))
    _check_dataset(None, IncrementEnv, SimpleNamespace(max_steps=10))
    _check_dataset([{"prompt": "p"}], IncrementEnv, SimpleNamespace(max_steps=-1))


def test_environment_tools_work_through_the_tool_loop(scripted_loop):
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": %d}}\n</tool_call>'

    async def rollout():
        runner = EnvironmentRunner(IncrementEnv, loop.tool_executor)
        episode = await runner.start({})
        target = episode.env.target
        loop._texts = [call % target, "Done."]
        result = await run_tool_loop(loop, episode.prompt, episode.tools, group_id=0)
        return result, await runner.finish(episode), target

    loop = scripted_loop([])
    result, reward, target = asyncio.run(rollout())
    assert json.loads(result.completion[1]["content"]) == target
    assert reward == (IncrementEnv, 1.0)
    assert "increment" in loop.tokenizer.decode(loop.prompts[0])  # schema rendered in the system turn


PAGE_SERVED = threading.Event()


class SlowToolEnv:
    """Its sync tool answers after `tool_timeout_s`, then writes to its instance."""

    def reset(self, **kwargs) -> str:
        self.fetched, self.fetching = [], threading.Event()
        return "Fetch page a."

    def fetch(self, url: str) -> str:
        """Fetch a page.

        Args:
            url: The page's address.
        """
        self.fetching.set()
        PAGE_SERVED.wait(30)
        self.fetched.append(url)
        return "page"

    def get_reward(self) -> float:
        return float(len(self.fetched))


@pytest.mark.timeout(60)
def test_an_instance_a_timed_out_sync_tool_still_runs_on_is_not_handed_to_the_next_rollout(
        scripted_loop):
    """A thread cannot be stopped, so a sync tool call past `tool_timeout_s` went on writing to
    its instance after `finish` had put it back in the pool: the next rollout was reset on it
    and then saw the old call's write (`fetched == ['a']` in a rollout that fetched nothing).
    Now that instance is dropped and the next rollout gets a fresh one; an instance nothing
    runs on is still reused."""
    call = '<tool_call>\n{"name": "fetch", "arguments": {"url": "a"}}\n</tool_call>'
    loop = scripted_loop([call, "Done."], tool_timeout_s=0.05)
    loop.tool_executor.shutdown(wait=False)
    loop.tool_executor = pool = RolloutThreadPool(4, "max_concurrent_rollouts")

    async def rollouts():
        runner = EnvironmentRunner(SlowToolEnv, pool)
        first = await runner.start({})
        result = await run_tool_loop(loop, first.prompt, first.tools, group_id=0)
        await runner.finish(first)
        second = await runner.start({})
        PAGE_SERVED.set()  # the timed-out call returns now and writes to its instance
        while pool.is_busy(first.env):
            await asyncio.sleep(0.01)
        second_reward = await runner.finish(second)
        third = await runner.start({})
        return result, first, second, second_reward, third

    PAGE_SERVED.clear()
    try:
        result, first, second, second_reward, third = asyncio.run(rollouts())
    finally:
        PAGE_SERVED.set()
    assert json.loads(result.completion[1]["content"]) == {"error": "Tool 'fetch' timed out after 0.05 s."}
    assert second.env is not first.env and first.env.fetched == ["a"]  # the late write landed there
    assert second.env.fetched == [] and second_reward == (SlowToolEnv, 0.0)
    assert third.env is second.env  # nothing ran on it: back in the pool as before


@pytest.mark.timeout(60)
def test_a_rollout_whose_own_tool_call_went_late_is_left_unscored_and_its_next_call_refused(
        scripted_loop):
    """The instance's own rollout raced its timed-out call too: its next `fetch` ran beside
    the late one, and `get_reward` read the late write (reward 1.0 or 2.0 for a rollout whose
    transcript says both fetches failed, depending on the thread timing). Now the next call on
    the instance is refused while the late one runs, and the environment leaves the rollout
    unscored whether or not the late call has returned by `finish`."""
    call = '<tool_call>\n{"name": "fetch", "arguments": {"url": "a"}}\n</tool_call>'
    loop = scripted_loop([call, call, "Done."], tool_timeout_s=0.05)
    loop.tool_executor.shutdown(wait=False)
    loop.tool_executor = pool = RolloutThreadPool(4, "max_concurrent_rollouts")

    async def rollout():
        runner = EnvironmentRunner(SlowToolEnv, pool)
        episode = await runner.start({})
        result = await run_tool_loop(loop, episode.prompt, episode.tools, group_id=0)
        PAGE_SERVED.set()  # the late call returns now and writes to the instance
        while pool.is_busy(episode.env):
            await asyncio.sleep(0.01)
        return episode, result, await runner.finish(episode)

    PAGE_SERVED.clear()
    try:
        episode, result, reward = asyncio.run(rollout())
    finally:
        PAGE_SERVED.set()
        pool.shutdown(wait=True)
    answers = [json.loads(m["content"]) for m in result.completion if m["role"] == "tool"]
    assert answers == [{"error": "Tool 'fetch' timed out after 0.05 s."},
                       {"error": "Tool 'fetch' was not run: the earlier call of 'fetch' timed out "
                                 "and still runs on the same environment."}]
    assert episode.env.fetched == ["a"]  # the late write landed, and only one
    assert reward is None  # get_reward would have read it: 1.0
    assert episode.metrics["env/late_call_unscored_count"] == [1.0]  # counted, not silent


@pytest.mark.timeout(60)
def test_a_cancelled_sync_tool_call_keeps_its_instance_busy_until_its_thread_returns():
    """A rollout cancelled mid-call (its group dropped) leaves the call's thread running on the
    instance: the pool marks it busy until the call returns, as for a timeout."""
    env, pool = SlowToolEnv(), RolloutThreadPool(4, "max_concurrent_rollouts")
    env.reset()

    async def cancel_mid_call():
        task = asyncio.create_task(execute_tool_call(ToolCall("fetch", {"url": "a"}), {"fetch": env.fetch},
                                                     pool, timeout_s=30))
        await asyncio.to_thread(env.fetching.wait, 10)  # the call runs in its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pool.is_busy(env)

    PAGE_SERVED.clear()
    try:
        busy_after_cancel = asyncio.run(cancel_mid_call())
    finally:
        PAGE_SERVED.set()
        pool.shutdown(wait=True)
    assert busy_after_cancel and env.fetched == ["a"]
    assert not pool.is_busy(env)  # the call returned: nothing runs on it any more



BUILT: list[SlowResetEnv] = []


class SlowResetEnv:
    """Its sync `reset` waits for the test, then writes to its instance."""

    def __init__(self):
        BUILT.append(self)
        self.resets, self.resetting = 0, threading.Event()

    def reset(self, **kwargs) -> str:
        self.resetting.set()
        PAGE_SERVED.wait(30)
        self.resets += 1
        return "Fetch page a."


@pytest.mark.timeout(60)
def test_an_instance_whose_cancelled_reset_still_runs_is_not_handed_to_the_next_rollout():
    """A rollout cancelled during a sync `reset` (the `env_reset` stall stage, a dropped group)
    put the instance back in the pool while `reset` still ran on it in its thread: the next
    rollout was handed it (reset twice, once by the cancelled call). Now it is dropped until
    that call returns, and the next rollout gets a fresh instance."""
    pool = RolloutThreadPool(4, "max_concurrent_rollouts")
    runner = EnvironmentRunner(SlowResetEnv, pool)

    async def cancel_then_start_again():
        first = asyncio.create_task(runner.start({}))
        while not BUILT:  # the factory runs in the pool, then reset
            await asyncio.sleep(0.01)
        await asyncio.to_thread(BUILT[0].resetting.wait, 10)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        PAGE_SERVED.set()  # the cancelled reset and the next one return now
        return await runner.start({})

    BUILT.clear()
    PAGE_SERVED.clear()
    try:
        second = asyncio.run(cancel_then_start_again())
    finally:
        PAGE_SERVED.set()
        pool.shutdown(wait=True)
    first_env = BUILT[0]
    assert second.env is not first_env and len(BUILT) == 2
    assert first_env.resets == 1 and second.env.resets == 1


@pytest.mark.timeout(60)
def test_a_cancelled_reset_that_holds_most_threads_stops_the_next_rollout_naming_it():
    """A reset cancelled with its rollout keeps its thread like a timed-out tool call, but the
    pool did not count it: with an environment whose reset always hangs past the `env_reset`
    stage, the pool drained one cancelled reset at a time and the next rollout waited for a
    thread. Now it counts, and the next rollout's start stops the run naming the reset."""
    from grpo_agent.rollout.concurrency import ToolThreadsHeldError

    pool = RolloutThreadPool(1, "max_concurrent_rollouts")
    runner = EnvironmentRunner(SlowResetEnv, pool)

    async def cancel_then_start_again():
        first = asyncio.create_task(runner.start({}))
        while not BUILT:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(BUILT[0].resetting.wait, 10)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        held = pool.held()
        with pytest.raises(ToolThreadsHeldError) as stopped:
            await asyncio.wait_for(runner.start({}), 5)  # not a wait for the held thread
        return held, str(stopped.value)

    BUILT.clear()
    PAGE_SERVED.clear()
    try:
        held, message = asyncio.run(cancel_then_start_again())
    finally:
        PAGE_SERVED.set()
        pool.shutdown(wait=True)
    assert held == {"SlowResetEnv.reset": 1}
    assert message.startswith(
        "Sync call 'SlowResetEnv.reset' was cancelled with its rollout (its group stalled or was "
        "dropped) and has not returned: timed-out or cancelled calls ('SlowResetEnv.reset' 1) "
        "hold 1 of the 1 threads (max_concurrent_rollouts)"), message
    assert pool.held() == {}  # the reset returned: its thread is free again


def test_an_episode_whose_rollout_ends_without_finish_is_not_watched_for_good(tiny_tokenizer, tmp_path):
    """The pool watches an episode's instance for late calls until `finish`; a rollout that
    raises (or is cancelled) before it is forgotten too, else each such rollout would keep
    its instance alive in the pool for the rest of the run."""
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.loop import AsyncRolloutLoop

    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none")
    loop = AsyncRolloutLoop(config=config, model_name="m", dataset=None, reward_funcs=[],
                            processing_class=tiny_tokenizer, eos_token_ids=[0])
    pool = RolloutThreadPool(2, "max_concurrent_rollouts")
    loop.env_runner = EnvironmentRunner(IncrementEnv, pool)
    started = []

    async def generate_one(prompt, tools, group_id):
        started.append(tools[0].__self__)
        raise RuntimeError("the server went away")

    loop.generate_one = generate_one
    try:
        with pytest.raises(RuntimeError, match="went away"):
            asyncio.run(loop.run_episode({}, 0, 0))
    finally:
        pool.shutdown(wait=True)
    assert started and not pool._watched  # it held the instance (and its id) alive
