"""`tools/*` metrics are logged only when the trainer has tools (the spec's rule), though the
tool loop counts calls either way; every kind of tool failure reaches its per-tool count."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from grpo_agent import AsyncGRPOConfig
from grpo_agent.metrics import MetricWindow
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.rollout.channels import METRICS_FLUSHED
from grpo_agent.rollout.environments import EnvironmentRewardError
from grpo_agent.rollout.group_scoring import build_group, score_group
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.observations import completion_observations
from grpo_agent.rollout.prompts import PromptSlot
from grpo_agent.rollout.scoring import RewardFailureTracker
from grpo_agent.sampler.errors import RequestRejectedError
from grpo_agent.stall import StageStalled
from grpo_agent.types import PromptConsumed, TurnRecord
from test_tool_loop import call, lookup, multiply

from tests.stand_in_engine import engine_on, make_engine


def rollout_of(loop, tools):
    prompt = [{"role": "user", "content": "What is 3 times 4?"}]
    return asyncio.run(run_tool_loop(loop, prompt, list(tools), group_id=0))


def test_no_tools_means_no_tools_metrics(scripted_loop):
    rollouts = [rollout_of(scripted_loop(["It is 12."]), []) for _ in range(2)]
    assert "tools/call_frequency" in rollouts[0].metrics  # counted by the loop...
    names = {name for name, _ in completion_observations(rollouts, with_tools=False)}
    assert "completions/mean_length" in names
    assert sorted(n for n in names if n.startswith("tools/")) == []  # ...but not logged


def test_with_tools_every_tools_metric_is_logged_with_its_value(scripted_loop):
    rollouts = [rollout_of(scripted_loop([call("multiply", a=3, b=4), "It is 12."]), [multiply]),
                rollout_of(scripted_loop(["It is 12."]), [multiply])]
    window = MetricWindow()
    window.extend(completion_observations(rollouts, with_tools=True))
    tools = {k: v for k, v in window.summarize().items() if k.startswith("tools/")}
    assert tools.pop("tools/latency_s") >= 0 and tools.pop("tools/multiply/latency_s") >= 0
    assert tools == {
        "tools/call_frequency": 0.5,  # one call over two rollouts
        "tools/failure_frequency": 0.0,
        "tools/parallel_calls_mean": 1.0,
        "tools/unknown_name_count": 0.0,
        "tools/malformed_call_count": 0.0,
        "tools/loop_exhausted_frac": 0.0,
        "tools/multiply/call_count": 1.0,
        "tools/multiply/failure_count": 0.0,
    }


async def wait_a_while(seconds: float) -> str:
    """
    Waits, then says so.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return "waited"


def _position_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


class _Stalls:
    """The stall watch at the seam: the scoring stage passes its deadline (`stalled`) or not."""

    def __init__(self, stalled: bool):
        self.stalled = stalled

    @contextlib.contextmanager
    def stage(self, name, **detail):
        if self.stalled and name == "scoring":
            raise StageStalled(f"{name} passed its deadline")
        yield


@pytest.mark.parametrize("scoring", ["scored", "stalled"])
def test_every_kind_of_tool_failure_reaches_its_tools_failure_count(scripted_loop, scoring):
    """Arguments that do not fit the signature, a tool that raises and one that times out, each
    through the real tool loop, then the real group building and scoring: each failure is in
    `tools/{name}/failure_count` of the window the group's observations reach, also for a group
    whose reward hung past the scoring deadline (dropped as stalled: its observations, tool
    failures included, were lost with it)."""
    tools = [multiply, lookup, wait_a_while]
    scripts = [[call("multiply", x=1), "?"], [call("lookup", key="boom"), "?"],
               [call("wait_a_while", seconds=30), "?"], [call("multiply", a=2, b=3), "6"]]
    loops = [scripted_loop(script, tool_timeout_s=0.05) for script in scripts]
    results = [(None, rollout_of(loop, tools), None) for loop in loops]
    failed = [m["content"] for _, r, _ in results for m in r.completion if m["role"] == "tool"]
    assert "do not fit" in failed[0] and "on fire" in failed[1] and "timed out" in failed[2]

    loop = SimpleNamespace(
        tools=tools, env_runner=None, reports_tools=False, runs_tools=True,
        tool_executor=loops[0].tool_executor, stalls=_Stalls(scoring == "stalled"),
        reward_funcs={"position": _position_reward},
        config=SimpleNamespace(advantage_estimator="grpo"),
        compute_advantages=lambda group: group.rewards - group.rewards.mean())
    slot = PromptSlot(prompt_index=0, row_index=0, epoch=0, row={"prompt": []})

    async def build_and_score():
        group = await build_group(loop, slot, 0, 0, results, lambda *a: None, lambda *a: None)
        return await score_group(loop, group, RewardFailureTracker())

    scored = asyncio.run(build_and_score())
    assert scored.reason == (None if scoring == "scored" else "stalled")
    window = MetricWindow()
    window.extend(scored.observations)
    logged = window.summarize()
    counts = {name: (logged[f"tools/{name}/call_count"], logged[f"tools/{name}/failure_count"])
              for name in ("multiply", "lookup", "wait_a_while")}
    assert counts == {"multiply": (2.0, 1.0), "lookup": (1.0, 1.0), "wait_a_while": (1.0, 1.0)}
    assert logged["tools/failure_frequency"] == 3 / 4


def test_a_group_dropped_for_a_siblings_error_keeps_the_finished_rollouts_tool_failures(
        scripted_loop):
    """One rollout ran the real tool loop (its `lookup` call raised), then its sibling's env
    `get_reward` raised: the group is dropped (`env_error`), and the finished rollout's tool call
    and failure were dropped with it. The spec counts a dropped group's tool calls."""
    tool_loop = scripted_loop([call("lookup", key="boom"), "?"])
    episodes = itertools.count()
    finished = asyncio.Event()

    async def run_episode(row, row_index, group_id):
        if next(episodes) == 0:
            prompt = [{"role": "user", "content": "Look up boom."}]
            rollout = await run_tool_loop(tool_loop, prompt, [lookup], group_id)
            finished.set()
            return prompt, rollout, None
        await finished.wait()
        await asyncio.sleep(0.05)  # the sibling's task has returned
        raise EnvironmentRewardError("CounterEnv.get_reward() raised KeyError: 'target'")

    engine, put = make_engine(tools=[lookup], env_runner=None, reports_tools=False,
                              runs_tools=True, run_episode=run_episode)
    engine._groups_in_flight = 1
    engine.slots.promise(2)  # as the dispatcher does
    slot = PromptSlot(prompt_index=0, row_index=0, epoch=0, row={})
    asyncio.run(engine._run_group(slot, 0))
    assert put == [PromptConsumed(0, 0, "env_error")]
    window = MetricWindow()
    window.extend(engine._observations)
    logged = window.summarize()
    assert logged["rollout/env_error_group_count"] == 1.0
    assert (logged["tools/lookup/call_count"], logged["tools/lookup/failure_count"]) == (1.0, 1.0)
    assert logged["tools/failure_frequency"] == 1.0


class StandInSampler:
    """The server at the loop's seam (`AsyncRolloutLoop.generate_one_turn` calls `generate`):
    each rollout (its task) follows the script `script_for` gives for its first prompt's text;
    a script's step is a reply's text, or a coroutine function awaited instead (to hang or
    raise, or to return the text once something else happened)."""

    retry_count = 0

    def __init__(self, tokenizer, script_for):
        self.tokenizer, self.script_for = tokenizer, script_for
        self.scripts = {}

    async def generate(self, prompt_ids, params, model=None):
        task = asyncio.current_task()
        if task not in self.scripts:
            self.scripts[task] = list(self.script_for(self.tokenizer.decode(prompt_ids)))
        step = self.scripts[task].pop(0)
        text = step if isinstance(step, str) else await step()
        output = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(prompt_ids, output, [-0.1] * len(output), finish_reason="stop")


def _tool_loop_on(tiny_tokenizer, tmp_path, script_for, tools, rows=(), reward_funcs=()):
    """A real `AsyncRolloutLoop` with `tools`, sampling from a `StandInSampler`."""
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", num_generations=2,
                             max_completion_length=64, share_first_turn_request=False,
                             chat_template_kwargs={"enable_thinking": False})
    loop = AsyncRolloutLoop(config=config, model_name="m", dataset=list(rows),
                            reward_funcs=list(reward_funcs), processing_class=tiny_tokenizer,
                            eos_token_ids=[tiny_tokenizer.eos_token_id], tools=list(tools))
    loop.sampler = StandInSampler(tiny_tokenizer, script_for)
    loop.tool_executor = ThreadPoolExecutor(4)
    return loop


TOO_LONG = RequestRejectedError(
    "POST http://x/inference/v1/generate was rejected with HTTP 400", status_code=400,
    server_message="The decoder prompt (length 3001) is longer than the maximum model length.")


def test_a_dropped_groups_unfinished_rollouts_keep_their_tool_failures(tiny_tokenizer, tmp_path):
    """The real engine and tool loop; only the server is a stand-in. One rollout's `lookup`
    call fails, then it waits for its next turn; its sibling's `multiply` call fails, then its
    next request is rejected as too long, which drops the group. Both failures happened, and
    the spec counts every one; the rollout cancelled part-way and the one whose own error
    dropped the group logged neither (only finished rollouts kept their observations)."""
    waiting = asyncio.Event()

    async def wait_forever():
        waiting.set()
        await asyncio.Event().wait()

    async def rejected():
        await waiting.wait()
        raise TOO_LONG

    scripts = [[call("lookup", key="boom"), wait_forever], [call("multiply", x=1), rejected]]
    loop = _tool_loop_on(tiny_tokenizer, tmp_path, lambda text: scripts.pop(0), [lookup, multiply])
    put, logged = _run_one_group(loop, "Look up boom, then multiply.")
    assert put == [PromptConsumed(0, 0, "prompt_too_long")]
    assert logged["rollout/prompt_too_long_group_count"] == 1.0
    assert (logged["tools/lookup/call_count"], logged["tools/lookup/failure_count"]) == (1.0, 1.0)
    assert (logged["tools/multiply/call_count"], logged["tools/multiply/failure_count"]) == (1.0, 1.0)
    assert logged["tools/failure_frequency"] == 1.0
    # Only what the calls observed: a rollout cut short has no length, turns or calls per rollout.
    assert not [key for key in logged if key.startswith("completions/")]
    assert "tools/call_frequency" not in logged and "rollout/turns_mean" not in logged


def test_the_tool_failures_of_groups_in_flight_when_the_run_ends_are_sent(tiny_tokenizer,
                                                                          tmp_path):
    """The real pipeline (dispatch, scoring, flushes) until the trainer stops it, with groups
    of both rows in flight: a "finish" row's group finished and hangs in its reward (any later
    one would queue), "hang" rows' groups wait for their second turn. Every rollout's `broken`
    call failed first. The worker's last flush carries each failure once; groups neither
    scored nor dropped logged none of theirs."""
    failed = []

    def broken(key: str) -> str:
        """
        Always fails.

        Args:
            key: Anything.
        """
        failed.append(key)
        raise RuntimeError("broken on purpose")

    hung, scoring = [], asyncio.Event()

    async def wait_forever():
        hung.append(1)
        await asyncio.Event().wait()

    async def hung_reward(completions, **kwargs):
        scoring.set()
        await asyncio.Event().wait()

    def script_for(text):
        return [call("broken", key="x"), "done" if "finish" in text else wait_forever]

    rows = [{"prompt": [{"role": "user", "content": word}]} for word in ("finish", "hang")]
    loop = _tool_loop_on(tiny_tokenizer, tmp_path, script_for, [broken], rows, [hung_reward])
    loop.score_queue_maxsize = 1
    engine, _, batches = engine_on(loop, cap=4)
    engine._groups_done, engine._group_tokens_total = 1, 10  # room for more than one group

    async def main():
        engine.score_queue = asyncio.Queue(loop.score_queue_maxsize)
        engine._fatal = asyncio.get_running_loop().create_future()
        pipeline = asyncio.create_task(engine._run_pipeline())
        slots = engine.slots

        async def settled():  # no call can be under way, nor start: the count is exact
            while not (scoring.is_set() and len(hung) >= 2 and len(hung) == slots.in_flight
                       and not slots.promised
                       and (engine.score_queue.full() or not slots.can_dispatch())):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(settled(), 30)
        engine.channels.stop.set()
        await asyncio.wait_for(pipeline, 10)

    try:
        asyncio.run(main())
    finally:
        loop.tool_executor.shutdown(wait=False)
    assert batches[-1] == METRICS_FLUSHED  # the worker's last word: what `finish` waits for
    window = MetricWindow()
    for batch in batches[:-1]:
        window.extend(batch)
    logged = window.summarize()
    assert len(failed) >= 4  # two groups at least, one of each row
    assert (logged["tools/broken/call_count"], logged["tools/broken/failure_count"]) == (
        len(failed), len(failed))



@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_tool_call_cut_off_with_its_dropped_group_counts_as_a_call_not_a_failure(
        tiny_tokenizer, tmp_path, kind):
    """The real engine and tool loop; only the server is a stand-in. One rollout's `slow` call
    is still running when its sibling's next request is rejected as too long, which drops the
    group and cancels the call. It started, so it counts as a call of `slow`, and as cut off
    (`cancelled_count`), not as the tool's failure. Before, it counted as nothing at all."""
    started, release = threading.Event(), threading.Event()
    if kind == "sync":
        def slow(key: str) -> str:
            """
            Runs until the test ends.

            Args:
                key: Anything.
            """
            started.set()
            release.wait(30)
            return key
    else:
        async def slow(key: str) -> str:
            """
            Runs until it is cancelled.

            Args:
                key: Anything.
            """
            started.set()
            await asyncio.Event().wait()

    async def rejected():
        while not started.is_set():
            await asyncio.sleep(0.01)
        raise TOO_LONG

    scripts = [[call("slow", key="k")], [call("multiply", a=3, b=4), rejected]]
    loop = _tool_loop_on(tiny_tokenizer, tmp_path, lambda text: scripts.pop(0), [slow, multiply])
    try:
        put, logged = _run_one_group(loop, "Be slow, then multiply.")
    finally:
        release.set()  # the cut-off call's thread
    assert put == [PromptConsumed(0, 0, "prompt_too_long")]
    assert (logged["tools/slow/call_count"], logged["tools/slow/failure_count"],
            logged["tools/slow/cancelled_count"]) == (1.0, 0.0, 1.0)
    assert (logged["tools/multiply/call_count"], logged["tools/multiply/failure_count"]) == (1.0, 0.0)
    assert logged["tools/failure_frequency"] == 0.0  # over the calls that ended: multiply's
    assert "tools/multiply/cancelled_count" not in logged


def _run_one_group(loop, content: str):
    """One group through the real engine, started as the dispatcher starts it: what it put on
    the sample queue, and its observations as one logging window summarizes them."""
    engine, put, _ = engine_on(loop)
    engine._groups_in_flight = engine._groups_generating = 1
    engine.slots.promise(2)  # as the dispatcher does
    try:
        asyncio.run(engine._run_group(PromptSlot(0, 0, 0, {"prompt": [
            {"role": "user", "content": content}]}), 0))
    finally:
        loop.tool_executor.shutdown(wait=False)
    window = MetricWindow()
    window.extend(engine._observations)
    return put, window.summarize()
