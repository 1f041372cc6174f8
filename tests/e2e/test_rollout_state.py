"""The prompt ledger behind rollout_state.json: nothing lost, nothing trained twice."""
from grpo_agent.train.checkpoint import PromptLedger, RolloutState
from grpo_agent.types import PromptConsumed, TrainingSample, TrainingSequence


def sample(prompt_index: int, group_size: int) -> TrainingSample:
    seq = TrainingSequence(token_ids=[1, 2, 3], trained_mask=[0, 1, 1], sampler_logprobs=[0.0] * 3)
    return TrainingSample(seq, advantage=1.0, model_version=0, group_id=prompt_index,
                          row_index=prompt_index, prompt_index=prompt_index,
                          group_num_samples=group_size)


def test_frontier_waits_for_every_sample_of_a_prompt_and_skips_consumed_notices():
    ledger = PromptLedger()
    assert ledger.record_trained([sample(0, 2), sample(1, 1)]) == [1]
    assert ledger.frontier == 0  # prompt 0 has one of its two samples trained
    ledger.record_consumed(PromptConsumed(prompt_index=2, row_index=2, reason="zero_std"))
    assert ledger.record_trained([sample(0, 2)]) == [0]
    assert ledger.frontier == 3


def test_resume_skips_prompts_finished_out_of_order_and_only_those(tmp_path):
    ledger = PromptLedger()
    ledger.record_trained([sample(0, 1), sample(2, 1), sample(4, 1)])
    state = ledger.state(model_version=7)
    assert state == RolloutState(1, [2, 4], 7)
    state.save(tmp_path)

    resumed = PromptLedger(RolloutState.load(tmp_path))
    assert resumed.frontier == 1
    assert [i for i in range(6) if resumed.already_consumed(i)] == [2, 4]
    resumed.record_trained([sample(1, 1)])
    assert resumed.frontier == 3  # 2 was consumed before the checkpoint
    resumed.record_consumed(PromptConsumed(prompt_index=4, row_index=4, reason="zero_std"))
    assert resumed.take_noticed() == {}  # 4 counts once, in the run before the checkpoint
    resumed.record_trained([sample(3, 1)])
    assert resumed.frontier == 5


def test_loading_a_checkpoint_without_rollout_state_says_what_is_wrong(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="not written by AsyncGRPOTrainer"):
        RolloutState.load(tmp_path)


def test_resume_picks_the_newest_checkpoint_that_finished_saving(tmp_path):
    from grpo_agent.train.checkpoint import last_complete_checkpoint

    for step in (3, 6, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
    RolloutState().save(tmp_path / "checkpoint-3")
    RolloutState().save(tmp_path / "checkpoint-6")  # checkpoint-9 was killed mid-save
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-6"


def test_frontier_after_counts_a_step_in_hand_without_changing_the_ledger():
    ledger = PromptLedger()
    ledger.record_trained([sample(0, 2)])
    in_hand = [sample(0, 2), sample(1, 2)]
    assert ledger.frontier_after(in_hand) == 1  # prompt 1 still misses a sample
    assert ledger.frontier_after([*in_hand, sample(1, 2)]) == 2
    assert ledger.frontier == 0 and ledger.record_trained([sample(0, 2)]) == [0]


class ScriptedWorker:
    """The seam StepSource pulls from: one scripted batch of items per pull, then nothing."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.pulls = 0
        self.recheck = lambda carry: carry  # the staleness rule's answer for a step's carry
        self.reported, self.finishes = [], []  # finish_step's step tokens and finish timeouts

    def recheck_carry(self, carry):
        return self.recheck(carry)

    def pull(self, timeout):
        self.pulls += 1
        return self.batches.pop(0) if self.batches else []

    # finish_step's side: the served version, the step tokens it reports, its metrics
    model_version = 0

    def report_step_tokens(self, tokens):
        self.reported.append(tokens)

    def finish(self, timeout_s):
        self.finishes.append(timeout_s)
        return False  # the worker did not answer in time

    def drain_metrics(self):
        return []


def step_source(batches, epoch_prompts):

    from grpo_agent.metrics import MetricWindow
    from grpo_agent.train.step_source import StepSource

    ledger = PromptLedger()
    return StepSource(
        ScriptedWorker(batches), ledger=ledger, window=MetricWindow(), no_progress_timeout=0,
        epochs_done=lambda in_hand=(): ledger.frontier_after(list(in_hand)) >= epoch_prompts)


def test_a_step_blocks_until_its_rows_are_full_and_carries_the_overflow():
    from grpo_agent.train.batching import StepPlanner

    # 3 tokens per sample, budget 7: two samples fill the single row of a step.
    source = step_source([[sample(0, 1)], [], [], [sample(1, 1), sample(2, 1)]], epoch_prompts=3)
    step, _ = source.next_step(StepPlanner(token_budget=7, num_processes=1, grad_accum_steps=1))
    assert [s.prompt_index for s in step] == [0, 1]  # waited through two empty pulls
    assert source.worker.pulls == 4
    source.ledger.record_trained(step)
    step, _ = source.next_step(StepPlanner(token_budget=7, num_processes=1, grad_accum_steps=1))
    assert [s.prompt_index for s in step] == [2]  # the carried sample; the epoch ends partial
    assert source.worker.pulls == 4


def test_a_carry_the_push_made_stale_is_noticed_as_consumed_not_trained():
    from grpo_agent.rollout.allowance import TokenAllowance
    from grpo_agent.train.batching import StepPlanner

    source = step_source([[sample(0, 1), sample(1, 1), sample(2, 1)]], epoch_prompts=3)
    on_policy = TokenAllowance(max_staleness=0, step_tokens=7)
    source.worker.recheck = lambda carry: on_policy.recheck_carry(carry, version=1)[0]
    step, _ = source.next_step(StepPlanner(token_budget=7, num_processes=1, grad_accum_steps=1))
    assert [s.prompt_index for s in step] == [0, 1]  # prompt 2's sample is carried
    source.ledger.record_trained(step)
    step, _ = source.next_step(StepPlanner(token_budget=7, num_processes=1, grad_accum_steps=1))
    assert step == []  # version 0 is stale under version 1: not trained
    assert source.ledger.frontier == 3  # prompt 2 counted consumed, so the epoch ends


def _plan(budget):
    from grpo_agent.train.batching import StepPlanner

    return StepPlanner(token_budget=budget, num_processes=1, grad_accum_steps=1)


def test_a_carry_opens_the_next_step_oldest_first():
    """The sample that did not fit comes before the rest of its pull: arrival order, so the
    oldest (the first to go stale) trains first."""
    source = step_source([[sample(i, 1) for i in range(4)]], epoch_prompts=10)
    assert [s.prompt_index for s in source.next_step(_plan(7))[0]] == [0, 1]
    assert [s.prompt_index for s in source.next_step(_plan(4))[0]] == [2]  # one 3-token sample


def test_samples_of_prompts_trained_before_a_resume_are_discarded():
    """The resumed worker starts at the frontier (0) and samples prompt 1 again, which the
    checkpoint's run already trained out of order: those samples are not trained twice."""
    source = step_source([[sample(i, 1) for i in range(4)]], epoch_prompts=10)
    source.ledger = PromptLedger(RolloutState(first_untrained_prompt_index=0, consumed_after_first=[1]))
    assert [s.prompt_index for s in source.next_step(_plan(7))[0]] == [0, 2]


def test_a_trainable_sample_resets_the_no_progress_count():
    """The no-progress guard counts groups dropped in a row: a sample that trains ends the row."""
    dropped = [PromptConsumed(prompt_index=i, row_index=i, reason="stalled") for i in (0, 1)]
    source = step_source([[*dropped, *(sample(i, 1) for i in (2, 3, 4))]], epoch_prompts=10)
    assert [s.prompt_index for s in source.next_step(_plan(7))[0]] == [2, 3]
    assert source.no_progress.dropped == {}


def test_staleness_is_counted_per_step_against_the_served_version_by_default(caplog):
    """Without `trained_version`, a step's staleness counts from the worker's served version;
    each step logs its own samples' staleness, and reports its forwarded tokens (the worker's
    staleness allowance); the last step stops the worker for its last metrics and says if
    they did not come."""
    import dataclasses

    stale = dataclasses.replace(sample(0, 1), model_version=0)
    fresh = [dataclasses.replace(sample(i, 1), model_version=2) for i in (1, 2, 3, 4)]
    source = step_source([[stale, *fresh]], epoch_prompts=10)
    source.worker.model_version = 2
    for expected in (1.0, 0.0):  # step 1: versions 0 and 2; step 2: the carry (2) and 2
        taken, _ = source.next_step(_plan(7))
        source.finish_step(taken, last=False)
        assert source.window.summarize()["sample/staleness_max"] == 2 * expected
    assert source.worker.reported == [6, 6]  # forwarded tokens: 2 samples of 3 (2 trained)
    assert source.worker.finishes == []
    with caplog.at_level("WARNING"):
        source.finish_step([], last=True)
    assert source.worker.finishes and "did not send its last metrics" in caplog.text


def test_rollout_state_round_trips_every_field_through_the_checkpoint(tmp_path):
    """The model version is restored too: a resumed run's samples are versioned after it."""
    state = RolloutState(first_untrained_prompt_index=5, consumed_after_first=[7, 9], model_version=12)
    state.save(tmp_path)
    assert RolloutState.load(tmp_path) == state
    assert not list(tmp_path.glob("*.partial"))  # written aside, then moved into place


def test_resume_orders_checkpoints_by_step_number_not_by_name(tmp_path):
    from grpo_agent.train.checkpoint import last_complete_checkpoint

    for step in (9, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
        RolloutState().save(tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-final").mkdir()  # not a step: never picked
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


def test_the_ledger_line_records_the_steps_prompts_and_the_resume_point(tmp_path):
    import json

    from grpo_agent.train.checkpoint import LEDGER_NAME, append_ledger_line

    ledger = PromptLedger()
    for index, reason in ((6, "stalled"), (2, "zero_std"), (7, "stalled")):
        ledger.record_consumed(PromptConsumed(prompt_index=index, row_index=index, reason=reason))
    append_ledger_line(tmp_path, step=3, completed=[4, 1], noticed=ledger.take_noticed(), frontier=5)
    append_ledger_line(tmp_path, step=4, completed=[], noticed=ledger.take_noticed(), frontier=5)
    first, second = (json.loads(line) for line in (tmp_path / LEDGER_NAME).read_text().splitlines())
    # Why each prompt went untrained is in the ledger (docs/reliability.md: a stalled group's
    # prompt is recorded as consumed with reason `stalled`, "the prompt ledger says why").
    assert {k: first[k] for k in ("step", "completed", "noticed", "reasons", "frontier")} == {
        "step": 3, "completed": [1, 4], "noticed": [2, 6, 7],
        "reasons": {"stalled": [6, 7], "zero_std": [2]}, "frontier": 5}
    assert second["step"] == 4 and first["pid"] == second["pid"]
    assert second["noticed"] == [] and second["reasons"] == {}


def test_frontier_after_moves_past_prompts_already_consumed_ahead():
    """A step in hand that completes the frontier prompt moves the resume point past every
    prompt consumed out of order before it (the epoch-end check relies on this)."""
    ledger = PromptLedger()
    ledger.record_consumed(PromptConsumed(prompt_index=1, row_index=1, reason="zero_std"))
    ledger.record_trained([sample(2, 1)])
    assert ledger.frontier == 0
    assert ledger.frontier_after([sample(0, 1)]) == 3


def test_resuming_asks_for_a_checkpoint_that_is_there(tmp_path):
    """True takes the newest complete checkpoint; with none, or a folder that is not there, the
    run is refused with what to do before anything starts."""
    import pytest
    from grpo_agent.train.checkpoint import ResumeError, resume_checkpoint

    assert resume_checkpoint(None, tmp_path) is None and resume_checkpoint(False, tmp_path) is None
    with pytest.raises(ResumeError, match=rf"{tmp_path} has no complete checkpoint-N folder.*"
                                          "Train without resume_from_checkpoint the first time"):
        resume_checkpoint(True, tmp_path)
    for step in (2, 10, 11):
        (tmp_path / f"checkpoint-{step}").mkdir()
    RolloutState().save(tmp_path / "checkpoint-2")
    RolloutState().save(tmp_path / "checkpoint-10")  # checkpoint-11 was cut short
    assert resume_checkpoint(True, tmp_path) == str(tmp_path / "checkpoint-10")
    assert resume_checkpoint(str(tmp_path / "checkpoint-2"), tmp_path) == str(tmp_path / "checkpoint-2")
    with pytest.raises(ResumeError, match="checkpoint folder .*checkpoint-3 does not exist"):
        resume_checkpoint(str(tmp_path / "checkpoint-3"), tmp_path)


def test_how_to_go_on_names_a_checkpoint_only_where_one_is_complete(tmp_path):
    from grpo_agent.train.checkpoint import resume_advice

    assert resume_advice(tmp_path) == "run it again (no checkpoint was written yet to resume from)"
    assert resume_advice(None).startswith("run it again")
    (tmp_path / "checkpoint-4").mkdir()
    assert resume_advice(tmp_path).startswith("run it again")  # cut short: no rollout_state.json
    RolloutState().save(tmp_path / "checkpoint-4")
    assert resume_advice(tmp_path, "--set x") == "resume from checkpoint-4 with --set x"


def test_a_streaming_dataset_restarts_from_its_first_prompt_keeping_the_weight_version(tmp_path, caplog):
    """A stream cannot be repositioned: its resume starts from the first prompt (with a warning)
    but keeps the checkpoint's weight version, which the server is pushed at."""
    from types import SimpleNamespace

    from grpo_agent.train.trainer import AsyncGRPOTrainer

    RolloutState(first_untrained_prompt_index=5, consumed_after_first=[7], model_version=3).save(tmp_path)
    stream = SimpleNamespace(train_dataset=iter([{"prompt": "a"}]))
    with caplog.at_level("WARNING"):
        state = AsyncGRPOTrainer._restored_rollout_state(stream, str(tmp_path))
    assert state == RolloutState(model_version=3)
    assert "restarts from the first prompt (rollout_state.json had 5)" in caplog.text
    indexed = SimpleNamespace(train_dataset=[{"prompt": "a"}] * 8)
    assert AsyncGRPOTrainer._restored_rollout_state(indexed, str(tmp_path)) == RolloutState(5, [7], 3)
    assert AsyncGRPOTrainer._restored_rollout_state(indexed, None) == RolloutState()
