"""Module-level rewards and loops for the worker tests (the spawned worker imports them by name).

`tests/rollout/conftest.py` puts this folder on `sys.path`; spawned children inherit it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from grpo_agent import AsyncGRPOConfig
from grpo_agent.trainer.async_grpo_trainer import AsyncRolloutLoop  # the spec's import path


def token_sum_reward(completion_ids, **kwargs):
    """A policy-independent but varied score: 1 when the token ids sum to a multiple of 3."""
    return [float(sum(ids) % 3 == 0) for ids in completion_ids]


def easy_or_token_reward(prompts, completion_ids, **kwargs):
    """Every rollout of an 'easy' prompt passes; others pass rarely."""
    easy = ["easy" in prompt[-1]["content"] for prompt in prompts]
    return [1.0 if is_easy else float(sum(ids) % 4 == 0) for is_easy, ids in zip(easy, completion_ids)]


def fails_on_some_rows(completion_ids, row_id, **kwargs):
    """Raises for rows whose id is a multiple of 4 (a flaky remote judge)."""
    if row_id[0] % 4 == 0:
        raise ConnectionError(f"judge unavailable for row {row_id[0]}")
    return [0.0] * len(completion_ids)


def always_fails(completion_ids, **kwargs):
    raise RuntimeError("this reward function is broken")


def wrong_length(completion_ids, **kwargs):
    return [1.0]


class HangingLoop(AsyncRolloutLoop):
    """Blocks its event loop (and so its heartbeat) after setup, like a deadlocked worker."""

    async def setup(self):
        import time
        time.sleep(3600)  # noqa: ASYNC251 - blocking the loop is the point


# --- the spec's CurriculumRolloutLoop example, with only the import lines changed -------------

@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


def child_cuda_visible_devices_reward(completion_ids, **kwargs):
    """Scores 1 only when the worker process hides every GPU."""
    return [float(os.environ.get("CUDA_VISIBLE_DEVICES") == "")] * len(completion_ids)


class DiesMidMessageLoop:
    """A worker that starts, then dies halfway through writing a metrics message (as a child
    whose queue feeder is cut off at exit, or that is killed, would)."""

    queue, dies_after_s = "metrics", 0.5

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def run(self):
        import os
        import struct
        import time

        self.kwargs["channels"].heartbeat.value = time.time()
        writer = getattr(self.kwargs["channels"], self.queue)._writer
        writer._send(struct.pack("!i", 1_000_000) + b"\0" * 100)  # a header promising 1 MB
        time.sleep(self.dies_after_s)
        os._exit(0)


class RewardKeepsRaisingLoop:
    """A worker whose loop fails as one whose reward raised on a window of groups does: an
    error whose message carries the reward's own traceback."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def run(self):
        from grpo_agent.rollout.scoring import RewardFunctionError

        raise RewardFunctionError(
            "Reward function 'judge' raised on 10 groups in a row, so the run stops. Its last "
            "traceback:\nTraceback (most recent call last):\n  File \"judge.py\", line 3, in judge\n"
            "ValueError: judge is down")


class DiesMidSampleLoop(DiesMidMessageLoop):
    """The same on the sample queue, dying only once the trainer's pull is reading the message."""

    queue, dies_after_s = "samples", 2.0


class FreezesMidSampleLoop:
    """A worker frozen (SIGSTOP: alive, its pipe open) halfway through writing a sample larger
    than the pipe holds, as a hand-run train's worker was when stopped while it sent samples:
    the trainer's read of that message would wait for the rest forever."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def run(self):
        import signal
        import struct
        import time

        self.kwargs["channels"].heartbeat.value = time.time()
        writer = self.kwargs["channels"].samples._writer
        writer._send(struct.pack("!i", 1_000_000) + b"\0" * 100)  # a header promising 1 MB
        os.kill(os.getpid(), signal.SIGSTOP)


class SlowToPickle(float):
    """A value whose pickling takes a while (in the queue's feeder thread, as a large batch
    would on a loaded machine)."""

    def __reduce__(self):
        import time

        time.sleep(0.5)
        return float, (float(self),)


class ObservesAsItStopsLoop:
    """A worker that beats until the trainer stops it, then sends one batch of observations as
    its last act (as the engine's final flush does) and returns at once."""

    def __init__(self, *, channels, **kwargs):
        self.channels = channels

    def run(self):
        import time

        while not self.channels.stop.is_set():
            self.channels.heartbeat.value = time.time()
            time.sleep(0.05)
        self.channels.metrics.put([("test/last", SlowToPickle(7.0))])


class ObservesOnceLoop:
    """A worker whose engine observes one value at start, then only beats and flushes, with a
    flush interval of an hour: the value reaches the trainer only with the engine's last
    observations, sent as it stops. Then it takes a minute to exit."""

    def __init__(self, *, channels, **kwargs):
        self.channels = channels

    def run(self):
        import asyncio
        import time
        from types import SimpleNamespace

        from grpo_agent.rollout import engine as engine_module

        engine_module.METRICS_FLUSH_INTERVAL_S = 3600.0
        hooks = SimpleNamespace(config=None, sampler=SimpleNamespace(retry_count=0))
        engine = engine_module.RolloutEngine(hooks, self.channels)
        engine.observe("test/observed_once", 1.0)

        async def main():
            tasks = [asyncio.create_task(c) for c in (engine._heartbeat(), engine._flush_metrics())]
            await engine._wait_for_stop()
            for task in tasks:
                task.cancel()
            engine._send_last_observations()

        asyncio.run(main())
        time.sleep(60)  # a slow exit (the interpreter's teardown): `finish` does not wait for it


class BoxedAnswerLoop(AsyncRolloutLoop):
    """Samples from the server, then answers `What is a + a?` in `\\boxed{}`: right on the odd
    rollouts of each group, wrong on the even ones, so accuracy_reward must tell them apart.

    It also checks two rules on the real path: no image part reaches `generate_one`, and
    `RolloutGroup.queued_at` is on the `time.monotonic()` clock (the spec's).
    """

    async def generate_one(self, prompt, tools, group_id=0):
        import re

        for message in prompt:
            if not isinstance(message["content"], str):
                raise TypeError(f"generate_one got a prompt with content parts: {prompt}")
        self.answered = getattr(self, "answered", {})
        self.answered[group_id] = count = self.answered.get(group_id, 0) + 1
        rollout = await super().generate_one(prompt, tools, group_id)
        a = int(re.search(r"What is (\d+)", prompt[-1]["content"]).group(1))
        answer = 2 * a if count % 2 else 2 * a + 1
        rollout.completion = [{"role": "assistant", "content": f"It is \\boxed{{{answer}}}."}]
        return rollout

    def compute_advantages(self, group):
        import time

        if abs(time.monotonic() - group.queued_at) > 600:
            raise ValueError(f"queued_at={group.queued_at} is not a time.monotonic() reading")
        return super().compute_advantages(group)


class HangsAfterFirstBeatLoop:
    """A worker that beats once and then hangs in blocking code (as a reward or tool that never
    returns would), ignoring the stop event: only the heartbeat deadline can catch it."""

    def __init__(self, *, channels, **kwargs):
        self.channels = channels

    def run(self):
        import time

        self.channels.heartbeat.value = time.time()
        time.sleep(3600)


class LosesTheServerLoop:
    """A worker that loses the server at once, as the engine does: it raises `server_down`, waits
    for the trainer to clear it, then observes that it dispatches again and beats until stopped."""

    def __init__(self, *, channels, **kwargs):
        self.channels = channels

    def run(self):
        import time

        self.channels.server_down.set()
        while self.channels.server_down.is_set() and not self.channels.stop.is_set():
            self.channels.heartbeat.value = time.time()
            time.sleep(0.05)
        self.channels.metrics.put([("test/dispatched_again", 1.0)])
        while not self.channels.stop.is_set():
            self.channels.heartbeat.value = time.time()
            time.sleep(0.05)


class DiesMidTracebackLoop(DiesMidMessageLoop):
    """The same on the error queue: killed while its traceback is being written, `failed` set."""

    queue, dies_after_s = "error", 2.0

    def run(self):
        self.kwargs["channels"].failed.set()
        super().run()


class WatchedThenHangsLoop:
    """A worker whose stall watch is running (its stacks-worker.txt written), that beats once and
    then hangs ignoring the stop event, so only stop()'s SIGTERM ends it, as on a run's SIGTERM."""

    def __init__(self, *, channels, config, **kwargs):
        self.channels, self.config = channels, config

    def run(self):
        import time

        from grpo_agent.stall import StallWatch

        StallWatch(self.config, "worker").start()
        self.channels.heartbeat.value = time.time()
        time.sleep(3600)
