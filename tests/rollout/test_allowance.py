"""The token allowance the trainer publishes and the dispatcher's rule for starting a group.

max_staleness >= 1: the window slides with every pull (the spec's rule). max_staleness = 0: the
window counts from the end of the last step and is held between taking a step and its push,
so a step gets one step of groups and none that would arrive stale. Samples more than
max_staleness versions old are dropped at pull, their group's prompt noticed once.
"""
from types import SimpleNamespace

import pytest
from grpo_agent.rollout.allowance import (
    HELD,
    WINDOW_GROW,
    WINDOW_SHRINK,
    TokenAllowance,
    has_room,
    holds_before_push,
    initial_step_tokens,
)
from grpo_agent.rollout.worker import RolloutWorker
from grpo_agent.types import PromptConsumed, TrainingSample, TrainingSequence


def _sample(tokens: int, version: int = 0, group_id: int = 0) -> TrainingSample:
    seq = TrainingSequence([1] * tokens, [0] + [1] * (tokens - 1), [0.0] * tokens)
    return TrainingSample(seq, advantage=1.0, model_version=version, group_id=group_id, row_index=0)


def test_the_window_slides_with_pulls_when_staleness_is_allowed():
    allowance = TokenAllowance(max_staleness=2, step_tokens=64)
    assert allowance.value() == 2 * 64  # full rows assumed before the first step
    allowance.after_step(50)
    allowance.after_pull([_sample(30)], version=0, now=0.0)
    assert allowance.value() == 30 + 2 * 50


def test_the_window_in_use_shrinks_when_samples_meet_the_bound_and_grows_back_below_it():
    allowance = TokenAllowance(max_staleness=4, step_tokens=100)
    allowance.after_pull([_sample(10, version=0)], version=4, now=0.0)  # at the bound: kept
    allowance.after_step(100)
    assert allowance.window_frac == WINDOW_SHRINK
    assert allowance.value() == 10 + round(WINDOW_SHRINK * 4 * 100)
    for group in range(20):  # a drop counts too; never below one step's worth
        kept, observations = allowance.after_pull([_sample(10, 0, group)], version=5, now=0.0)
        assert isinstance(kept[0], PromptConsumed)
        assert ("rollout/staleness_window_frac", allowance.window_frac) in observations
        allowance.after_step(100)
    assert allowance.window_frac == 1 / 4 and allowance.window_tokens == 100
    for steps in range(1, 100):  # fresh samples: back up to the spec's window, not past it
        allowance.after_pull([_sample(10, version=5)], version=6, now=0.0)
        allowance.after_step(100)
        if allowance.window_frac == 1.0:
            break
    assert steps == round((1 - 1 / 4) / WINDOW_GROW)
    allowance.after_step(100)
    assert allowance.window_tokens == 4 * 100


def test_a_carry_at_the_bound_shrinks_the_window_too_and_one_step_windows_never_change():
    allowance = TokenAllowance(max_staleness=2, step_tokens=100)
    allowance.recheck_carry([_sample(10, version=0)], version=2)
    allowance.after_step(100)
    assert allowance.window_frac == WINDOW_SHRINK
    for max_staleness in (0, 1):  # the spec's window is one step: nothing below it to adapt to
        allowance = TokenAllowance(max_staleness=max_staleness, step_tokens=100)
        allowance.after_pull([_sample(10, version=0)], version=3, now=0.0)
        allowance.after_step(100)
        assert allowance.window_frac == 1.0 and allowance.window_tokens == 100


def test_max_staleness_zero_gives_each_version_one_step_and_holds_until_the_push():
    allowance = TokenAllowance(max_staleness=0, step_tokens=64)
    assert holds_before_push(0) and not holds_before_push(1)
    allowance.after_step(50)
    allowance.after_pull([_sample(30), _sample(20)], version=0, now=0.0)  # the step fills
    assert allowance.value() == 50  # pulls do not admit the next step
    allowance.hold()  # the step is training
    allowance.after_pull([_sample(10)], version=0, now=0.0)
    assert allowance.value() == HELD
    allowance.after_step(50)  # after the push: one step from what was pulled so far
    assert allowance.value() == 60 + 50


def test_stale_samples_drop_at_pull_and_their_prompt_is_noticed_once_per_group():
    allowance = TokenAllowance(max_staleness=1, step_tokens=64)
    fresh, old, older = _sample(4, version=2), _sample(4, version=0, group_id=7), _sample(4, version=0, group_id=7)
    kept, observations = allowance.after_pull([fresh, old, older], version=2, now=0.0)
    assert kept[0] is fresh
    assert kept[1:] == [PromptConsumed(0, 0, "stale")]  # one notice for the group's two samples
    assert allowance.consumed == 12  # stale samples count: they were generated
    assert ("sample/dropped_stale_count", 2.0) in observations
    # a kept sample's staleness is counted where a step takes it (StepSource), not here
    assert not [name for name, _ in observations if name.startswith("sample/staleness")]


def test_a_carry_the_push_made_stale_drops_without_counting_its_tokens_twice():
    on_policy = TokenAllowance(max_staleness=0, step_tokens=64)
    carry = [_sample(4, version=0, group_id=3), _sample(4, version=0, group_id=3)]
    on_policy.after_pull(carry, version=0, now=0.0)  # fresh at its pull
    kept, observations = on_policy.recheck_carry(carry, version=1)  # a push later
    assert kept == [PromptConsumed(0, 0, "stale")]
    assert on_policy.consumed == 8
    assert observations == [("sample/dropped_stale_count", 2.0)]  # observed once, at the pull

    one_behind = TokenAllowance(max_staleness=1, step_tokens=64)
    kept, observations = one_behind.recheck_carry(carry, version=1)
    assert kept == carry and observations == [("sample/dropped_stale_count", 0.0)]


def test_the_worker_publishes_the_allowance_sized_by_the_token_budget_it_is_given():
    config = SimpleNamespace(max_staleness=1, token_budget=None, gradient_accumulation_steps=2,
                             rollout_worker_timeout=60.0, seed=0, max_completion_length=8,
                             num_generations=2)
    worker = RolloutWorker(object, config=config, model_name="unused", dataset=[],
                           reward_funcs=[], processing_class=None, token_budget=100)
    assert worker.channels.token_allowance.value == 1 * 100 * 2
    worker.hold_admission()
    assert worker.channels.token_allowance.value == HELD
    worker.report_step_tokens(30)
    assert worker.channels.token_allowance.value == 30


@pytest.mark.parametrize(("max_staleness", "value", "in_flight", "queued", "room"), [
    (1, 500, 1, 300, True),    # 400 committed < 500
    (1, 500, 2, 300, False),   # 500 committed: the window is full
    (1, 500, 0, 500, False),   # queued for a busy trainer: staleness bound, not starvation
    (0, 500, 0, 500, True),    # sync: nothing in flight while the step fills -> one more group
    (0, 500, 1, 400, False),
    (0, HELD, 0, 0, False),    # held until the push, even with nothing in flight
])
def test_dispatcher_room_rule(max_staleness, value, in_flight, queued, room):
    assert has_room(value, max_staleness=max_staleness, queued_tokens=queued,
                    groups_in_flight=in_flight, groups_done=4, group_tokens_total=400) is room


def test_before_any_group_finished_groups_start_one_at_a_time():
    assert has_room(1e9, max_staleness=1, queued_tokens=0, groups_in_flight=0, groups_done=0,
                    group_tokens_total=0)
    assert not has_room(1e9, max_staleness=1, queued_tokens=0, groups_in_flight=1, groups_done=0,
                        group_tokens_total=0)


def test_without_any_token_budget_a_row_holds_one_group_of_full_completions():
    config = SimpleNamespace(max_staleness=1, token_budget=None, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0, max_completion_length=8,
                             num_generations=3)
    worker = RolloutWorker(object, config=config, model_name="unused", dataset=[],
                           reward_funcs=[], processing_class=None)
    assert worker.channels.token_allowance.value == 1 * 8 * 3


def test_before_the_first_step_a_step_is_full_rows_on_every_rank():
    """Until the trainer reports a step, one step is `token_budget` tokens per micro-batch, per
    accumulation step, per rank (a world size of 0, no process group, counts as one rank)."""
    assert initial_step_tokens(256, grad_accum_steps=3, world_size=2) == 256 * 3 * 2
    assert initial_step_tokens(256, grad_accum_steps=3, world_size=0) == 256 * 3


def test_staleness_counts_from_the_version_that_trains_the_step_not_the_served_one():
    """A step planned ahead is pulled while the last push is still in flight: the served
    version (the worker's) lags the trainer's by one. Counted from the served one, a step
    trained by version 1 on version-0 samples logged `sample/staleness_max` 0 (the demo's step
    2: 0, with a float32 log-prob gap of 0.6), a carry trained a push after its pull kept its
    pull's count, and a carry one version past max_staleness was trained."""
    import time

    from grpo_agent.metrics import MetricWindow
    from grpo_agent.train.batching import StepPlanner
    from grpo_agent.train.checkpoint import PromptLedger
    from grpo_agent.train.step_source import StepSource

    config = SimpleNamespace(max_staleness=1, token_budget=None, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0, max_completion_length=8,
                             num_generations=1)
    worker = RolloutWorker(object, config=config, model_name="unused", dataset=[],
                           reward_funcs=[], processing_class=None, token_budget=8)
    worker._process = SimpleNamespace(pid=None, is_alive=lambda: True)  # no child: we queue
    worker.channels.heartbeat.value = time.time()
    trainer = SimpleNamespace(version=1)  # pushed version 1; the server still serves 0
    window = MetricWindow()
    ledger = PromptLedger()
    source = StepSource(worker, ledger=ledger, epochs_done=lambda taken=(): False, window=window,
                        no_progress_timeout=0, trained_version=lambda: trainer.version)

    def queue(prompt: int, version: int) -> None:
        seq = TrainingSequence([1, 2, 3], [0, 1, 1], [0.0] * 3)
        worker.channels.samples.put(TrainingSample(
            seq, advantage=1.0, model_version=version, group_id=prompt, row_index=prompt,
            prompt_index=prompt, group_num_samples=1))

    def step() -> tuple[list[int], dict[str, float]]:
        taken, _ = source.next_step(StepPlanner(token_budget=7, num_processes=1, grad_accum_steps=1))
        ledger.record_trained(taken)
        source.finish_step(taken, last=False)
        return [s.prompt_index for s in taken], window.summarize()

    for prompt in range(3):
        queue(prompt, version=0)
    time.sleep(0.5)  # the queue's feeder thread
    taken, metrics = step()  # one pull takes all three; two fit, prompt 2 is carried
    assert taken == [0, 1]
    assert metrics["sample/staleness_max"] == metrics["sample/staleness_mean"] == 1.0
    worker.set_model_version(1)
    trainer.version = 2  # the next push is in flight: the carry is 2 versions old now
    for prompt in (3, 4, 5):  # the third overflows, so the step is full
        queue(prompt, version=1)
    queue(6, version=0)  # a slow group: fresh enough for the served version, not the trained
    time.sleep(0.5)
    taken, metrics = step()
    assert taken == [3, 4]  # the carry dropped (2 > max_staleness=1); it was trained
    assert ledger.take_noticed() == {2: "stale", 6: "stale"}  # 6 at its pull
    assert metrics["sample/staleness_max"] == 1.0 and metrics["sample/dropped_stale_count"] == 2.0
