"""The token allowance the trainer publishes and the dispatcher's rule for starting a group.

max_staleness >= 1: the window slides with every pull (the spec's rule). max_staleness = 0: the
window counts from the end of the last step and is held between taking a step and its push,
so a step gets one step of groups and none that would arrive stale.
"""
from types import SimpleNamespace

import pytest
from grpo_agent.rollout.loop import ALLOWANCE_HELD, AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker
from grpo_agent.types import TrainingSample, TrainingSequence


def _worker(max_staleness: int) -> RolloutWorker:
    config = SimpleNamespace(max_staleness=max_staleness, token_budget=64,
                             gradient_accumulation_steps=1, rollout_worker_timeout=60.0, seed=0)
    return RolloutWorker(AsyncRolloutLoop, config=config, model_name="unused", dataset=[],
                         reward_funcs=[], processing_class=None)


def _sample(tokens: int, version: int = 0) -> TrainingSample:
    seq = TrainingSequence([1] * tokens, [0] + [1] * (tokens - 1), [0.0] * tokens)
    return TrainingSample(seq, advantage=1.0, model_version=version, group_id=0, row_index=0)


def _pull(worker: RolloutWorker, *samples: TrainingSample) -> None:
    worker._drop_stale(list(samples))  # what pull() does with what it read from the queue


def _allowance(worker: RolloutWorker) -> float:
    return worker._token_allowance.value


def test_the_window_slides_with_pulls_when_staleness_is_allowed():
    worker = _worker(max_staleness=2)
    assert _allowance(worker) == 2 * 64  # full rows assumed before the first step
    worker.report_step_tokens(50)
    _pull(worker, _sample(30))
    assert _allowance(worker) == 30 + 2 * 50


def test_max_staleness_zero_gives_each_version_one_step_and_holds_until_the_push():
    worker = _worker(max_staleness=0)
    worker.report_step_tokens(50)
    _pull(worker, _sample(30), _sample(20))  # the step fills: pulls do not admit the next step
    assert _allowance(worker) == 50
    worker.hold_admission()  # the step is training
    _pull(worker, _sample(10))
    assert _allowance(worker) == ALLOWANCE_HELD
    worker.set_model_version(1)
    worker.report_step_tokens(50)  # after the push: one step from what was pulled so far
    assert _allowance(worker) == 60 + 50


def _loop(max_staleness: int, allowance: float, in_flight: int, queued: int) -> AsyncRolloutLoop:
    loop = object.__new__(AsyncRolloutLoop)  # only the dispatcher's bookkeeping is needed
    loop.config = SimpleNamespace(max_staleness=max_staleness)
    loop.token_allowance = SimpleNamespace(value=allowance)
    loop._groups_done, loop._group_tokens_total = 4, 400  # 100 tokens per group
    loop._groups_in_flight, loop._queued_tokens = in_flight, queued
    return loop


@pytest.mark.parametrize(("max_staleness", "allowance", "in_flight", "queued", "room"), [
    (1, 500, 1, 300, True),    # 400 committed < 500
    (1, 500, 2, 300, False),   # 500 committed: the window is full
    (1, 500, 0, 500, False),   # queued for a busy trainer: staleness bound, not starvation
    (0, 500, 0, 500, True),    # sync: nothing in flight while the step fills -> one more group
    (0, 500, 1, 400, False),
    (0, ALLOWANCE_HELD, 0, 0, False),  # held until the push, even with nothing in flight
])
def test_dispatcher_room_rule(max_staleness, allowance, in_flight, queued, room):
    assert _loop(max_staleness, allowance, in_flight, queued)._allowance_has_room() is room
