"""A group's shared first turns (`rollout.first_turns`), with a recording `send` at the seam.

The real-server side (records from one request with `n` against per-rollout requests, a group
whose rollouts take different numbers of turns) is `test_first_turns_vllm.py`.
"""
from __future__ import annotations

import asyncio

import pytest
from grpo_agent.rollout import first_turns
from grpo_agent.rollout.first_turns import SharedFirstTurns
from grpo_agent.sampler.client import SamplingParams
from grpo_agent.types import TurnRecord

PARAMS = SamplingParams(max_tokens=4)
HANG_GUARD_S = 60.0  # only so a broken barrier fails instead of hanging; never reached when right


@pytest.fixture(autouse=True)
def no_timer(monkeypatch):
    """The fallback timer far away: each test sees the barrier alone, whatever the box's load."""
    monkeypatch.setattr(first_turns, "WAIT_S", 3600.0)


class Recorder:
    """The seam: records each request and answers choice i with output [100 * request + i]."""

    def __init__(self, error: Exception | None = None):
        self.requests: list[tuple[list[int], int]] = []
        self.error = error

    async def send(self, prompt_ids, params, model, n):
        self.requests.append((list(prompt_ids), n))
        base = 100 * len(self.requests)
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        return [TurnRecord(prompt_ids=list(prompt_ids), output_ids=[base + i]) for i in range(n)]


async def rollout(shared, recorder, prompts, before=None):
    """One rollout as the engine runs it: a ticket, then its turns (the first may be shared)."""
    with shared.ticket():
        if before is not None:
            await before
        outputs = []
        for prompt in prompts:
            group = first_turns.claim()
            if group is not None:
                turn = await group.sample(prompt, PARAMS, None, recorder.send)
            else:
                turn = (await recorder.send(prompt, PARAMS, None, 1))[0]
            outputs.append((turn.prompt_ids, turn.output_ids[0]))
        return outputs


def run_group(*coroutines):
    async def main():
        return await asyncio.wait_for(asyncio.gather(*coroutines), HANG_GUARD_S)
    return asyncio.run(main())


def test_equal_first_prompts_go_as_one_request_and_later_turns_per_rollout():
    shared, recorder = SharedFirstTurns(4), Recorder()
    turns = [[1, 2]] + [[1, 2, 9, i] for i in range(1, 4)]  # rollout k takes k + 1 turns
    results = run_group(*(rollout(shared, recorder, turns[:k + 1]) for k in range(4)))
    assert recorder.requests[0] == ([1, 2], 4)  # the four first turns: one request with n=4
    assert sorted(n for _, n in recorder.requests[1:]) == [1] * 6  # 1 + 2 + 3 later turns
    firsts = [outputs[0] for outputs in results]
    assert sorted(output for _, output in firsts) == [100, 101, 102, 103]  # each its own choice
    assert all(prompt == [1, 2] for prompt, _ in firsts)
    assert [len(outputs) for outputs in results] == [1, 2, 3, 4]
    assert shared.requests_sent == [4]


def test_different_first_prompts_are_never_merged():
    shared, recorder = SharedFirstTurns(5), Recorder()
    prompts = [[1], [2], [1], [2], [3]]
    results = run_group(*(rollout(shared, recorder, [p]) for p in prompts))
    assert sorted((tuple(p), n) for p, n in recorder.requests) == [((1,), 2), ((2,), 2), ((3,), 1)]
    for (prompt, output), asked in zip((r[0] for r in results), prompts):
        assert prompt == asked
        sent = next(i for i, (p, _) in enumerate(recorder.requests) if p == asked)
        assert output // 100 == sent + 1  # the answer came from its own prompt's request


def test_a_rollout_that_ends_without_asking_does_not_hold_its_siblings():
    shared, recorder = SharedFirstTurns(3), Recorder()

    async def leaves_later():
        with shared.ticket():
            await asyncio.sleep(0.05)  # asks nothing (a custom loop, a failed reset), then ends

    results = run_group(rollout(shared, recorder, [[5]]), rollout(shared, recorder, [[5]]),
                        leaves_later())
    assert recorder.requests == [([5], 2)] and len(results) == 3


def test_a_sibling_still_rendering_is_waited_for():
    """The barrier: a request goes out only once every ticket holder asked (or ended)."""
    shared, recorder = SharedFirstTurns(3), Recorder()
    release = asyncio.Event()

    async def main():
        early = [asyncio.ensure_future(rollout(shared, recorder, [[7]])) for _ in range(2)]
        late = asyncio.ensure_future(rollout(shared, recorder, [[7]], before=release.wait()))
        for _ in range(20):
            await asyncio.sleep(0)
        sent_before = list(recorder.requests)
        release.set()
        await asyncio.wait_for(asyncio.gather(*early, late), HANG_GUARD_S)
        return sent_before

    assert asyncio.run(main()) == [] and recorder.requests == [([7], 3)]


def test_a_rollout_away_for_its_slot_is_not_waited_for():
    """Siblings holding slots ask; one waits for a slot they hold: they go without it."""
    shared, recorder = SharedFirstTurns(3), Recorder()

    async def main():
        slot_free = asyncio.Event()

        async def waits_for_slot():
            with shared.away():
                await slot_free.wait()

        late = asyncio.ensure_future(rollout(shared, recorder, [[8]], before=waits_for_slot()))
        await asyncio.wait_for(
            asyncio.gather(*(rollout(shared, recorder, [[8]]) for _ in range(2))), HANG_GUARD_S)
        sent_before = list(recorder.requests)
        slot_free.set()  # a slot freed: the last one asks alone
        await asyncio.wait_for(late, HANG_GUARD_S)
        return sent_before

    assert asyncio.run(main()) == [([8], 2)] and recorder.requests == [([8], 2), ([8], 1)]


def test_the_fallback_timer_sends_what_waits(monkeypatch):
    """A holder blocked on something else (here: forever) delays its siblings by WAIT_S only."""
    monkeypatch.setattr(first_turns, "WAIT_S", 0.01)
    shared, recorder = SharedFirstTurns(3), Recorder()

    async def main():
        blocked = asyncio.ensure_future(rollout(shared, recorder, [[3]], before=asyncio.Event().wait()))
        outputs = await asyncio.wait_for(
            asyncio.gather(*(rollout(shared, recorder, [[3]]) for _ in range(2))), HANG_GUARD_S)
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)
        return outputs

    assert len(asyncio.run(main())) == 2 and recorder.requests == [([3], 2)]


def test_a_failed_request_fails_every_asker_with_its_error():
    error = RuntimeError("the server said no")
    shared, recorder = SharedFirstTurns(3), Recorder(error)

    async def main():
        return await asyncio.wait_for(asyncio.gather(
            *(rollout(shared, recorder, [[4]]) for _ in range(3)), return_exceptions=True), HANG_GUARD_S)

    assert asyncio.run(main()) == [error] * 3 and recorder.requests == [([4], 3)]


def test_close_cancels_a_request_in_flight():
    shared = SharedFirstTurns(2)
    started, cancelled = asyncio.Event(), []

    async def slow_send(prompt_ids, params, model, n):
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise

    async def asker():
        with shared.ticket():
            await first_turns.claim().sample([1], PARAMS, None, slow_send)

    async def main():
        askers = [asyncio.ensure_future(asker()) for _ in range(2)]
        await asyncio.wait_for(started.wait(), HANG_GUARD_S)
        for task in askers:  # the group is dropped: its rollouts are cancelled, then closed
            task.cancel()
        await asyncio.gather(*askers, return_exceptions=True)
        await shared.close()

    asyncio.run(main())
    assert cancelled == [2]


def test_outside_a_group_nothing_is_claimed():
    async def main():
        return first_turns.claim()

    assert asyncio.run(main()) is None


def test_equal_prompts_with_other_sampling_settings_or_model_are_not_merged():
    shared, recorder = SharedFirstTurns(4), Recorder()
    asks = [(PARAMS, None), (PARAMS, None), (SamplingParams(max_tokens=8), None), (PARAMS, "adapter-1")]
    seen = []

    async def send(prompt_ids, params, model, n):
        seen.append((params.max_tokens, model, n))
        return await recorder.send(prompt_ids, params, model, n)

    async def asker(params, model):
        with shared.ticket():
            return await first_turns.claim().sample([1], params, model, send)

    run_group(*(asker(params, model) for params, model in asks))
    assert sorted(seen, key=str) == sorted([(4, None, 2), (8, None, 1), (4, "adapter-1", 1)], key=str)


def test_an_asker_cancelled_before_the_request_is_not_sampled_for():
    """Its sibling's request asks for one choice; a group whose every asker was cancelled
    sends nothing."""
    shared, recorder = SharedFirstTurns(3), Recorder()
    alone, alone_recorder = SharedFirstTurns(2), Recorder()

    async def main():
        asking = [asyncio.ensure_future(rollout(shared, recorder, [[6]])) for _ in range(2)]
        gone = asyncio.ensure_future(rollout(alone, alone_recorder, [[6]]))
        for _ in range(5):
            await asyncio.sleep(0)
        asking[0].cancel()
        gone.cancel()
        await asyncio.gather(asking[0], gone, return_exceptions=True)
        with alone.ticket():  # the other rollout ends without asking: the group sends
            pass
        return await asyncio.wait_for(asyncio.gather(asking[1], rollout(shared, recorder, [[6]])),
                                      HANG_GUARD_S)

    assert len(asyncio.run(main())) == 2
    assert recorder.requests == [([6], 2)] and shared.requests_sent == [2]
    assert alone_recorder.requests == [] and alone.requests_sent == []


@pytest.mark.parametrize("sent", [False, True], ids=["waiting", "in-flight"])
def test_close_cancels_askers_whether_their_request_went_out_or_not(sent):
    """Closing the group ends its askers (cancelled), also when nothing cancelled them first."""
    shared = SharedFirstTurns(3 if not sent else 1)
    started = asyncio.Event()

    async def slow_send(prompt_ids, params, model, n):
        started.set()
        await asyncio.sleep(3600)

    async def asker():
        with shared.ticket():
            await first_turns.claim().sample([1], PARAMS, None, slow_send)

    async def main():
        task = asyncio.ensure_future(asker())
        if sent:
            await asyncio.wait_for(started.wait(), HANG_GUARD_S)
        else:
            for _ in range(5):
                await asyncio.sleep(0)
        await shared.close()
        done, _ = await asyncio.wait([task], timeout=5.0)
        return task, done

    task, done = asyncio.run(main())
    assert task in done and task.cancelled()
