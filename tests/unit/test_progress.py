"""The run's progress bar: the step total when it is known and the last known reward."""
from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
from grpo_agent.train import reporting
from grpo_agent.train.reporting import ProgressCallback, bar_extent, position_text, train_status
from rich.console import Console


def args(max_steps=-1, epochs=3.0):
    return SimpleNamespace(max_steps=max_steps, num_train_epochs=epochs)


def state(step, epoch=None):
    return SimpleNamespace(global_step=step, epoch=epoch, is_world_process_zero=True)


def test_the_total_is_max_steps_or_the_prompt_epochs():
    assert bar_extent(args(max_steps=10), state(3, 0.1)) == (10.0, 3.0)
    assert position_text(args(max_steps=10), state(3, 0.1)) == "step 3/10"
    assert bar_extent(args(epochs=2), state(5, 0.5)) == (2.0, 0.5)
    assert position_text(args(epochs=2), state(5, 0.5)) == "step 5  epoch 0.50/2"
    assert bar_extent(args(epochs=2), state(0)) == (None, 0.0)


def test_a_window_without_a_scored_rollout_shows_the_last_known_reward_not_nan():
    assert train_status({"reward": math.nan}, None) == "reward -"
    status = train_status({"reward": math.nan, "perf/step_s": 1.5, "rollout/queue_size": math.nan}, 0.25)
    assert status == "reward 0.250  step 1.50s"
    assert "nan" not in status


def test_the_bar_keeps_the_last_reward_and_counts_to_max_steps():
    bar = ProgressCallback(Console(file=io.StringIO(), force_terminal=True))
    run_args = args(max_steps=4)
    bar.on_epoch_begin(run_args, state(0, 0.0), None)
    try:
        task = bar._progress.tasks[0]
        assert task.total == 4 and task.fields["position"] == "step 0/4"
        bar.on_log(run_args, state(1, 0.1), None, logs={"loss": 0.1, "reward": 0.5})
        bar.on_log(run_args, state(2, 0.2), None, logs={"loss": 0.1, "reward": math.nan})
        bar.on_log(run_args, state(2, 0.2), None, logs={"eval/pass@1": 1.0, "eval/step": 2.0})
        assert task.completed == 2 and task.fields["position"] == "step 2/4"
        assert task.fields["status"].startswith("reward 0.500")
        assert "eval@2 pass@1 1.00" in task.fields["status"] and "nan" not in task.fields["status"]
    finally:
        bar.on_train_end(run_args, state(2), None)


def test_off_a_terminal_progress_goes_out_as_plain_lines_throttled_but_every_evaluation(monkeypatch):
    """A log file or batch job sees nothing of a live bar until the end: lines instead."""
    out = io.StringIO()
    bar = ProgressCallback(Console(file=out, width=200))
    run_args = args(max_steps=4)
    monkeypatch.setattr(reporting, "PLAIN_LINE_INTERVAL_S", 3600.0)
    bar.on_epoch_begin(run_args, state(0, 0.0), None)
    bar.on_log(run_args, state(1, 0.1), None, logs={"loss": 0.1, "reward": 0.5})  # held back
    bar.on_log(run_args, state(2, 0.2), None, logs={"eval/pass@1": 0.75, "eval/step": 2.0})
    monkeypatch.setattr(reporting, "PLAIN_LINE_INTERVAL_S", 0.0)
    bar.on_log(run_args, state(3, 0.3), None, logs={"loss": 0.1, "reward": 0.25})
    bar.on_log(run_args, state(4, 0.4), None, logs={"loss": 0.1, "reward": 1.0})
    bar.on_train_end(run_args, state(4), None)  # its line already went out: not repeated
    lines = out.getvalue().splitlines()
    assert [line.split("  [")[0] for line in lines] == [
        "train step 0/4  waiting for rollouts",
        "train step 2/4  reward 0.500  eval@2 pass@1 0.75",
        "train step 3/4  reward 0.250  eval@2 pass@1 0.75",
        "train step 4/4  reward 1.000  eval@2 pass@1 0.75",
    ]
    assert all(line.endswith("]") for line in lines)  # the elapsed time, [HH:MM:SS]


def test_off_a_terminal_the_final_state_is_printed_when_throttling_held_it_back(monkeypatch):
    out = io.StringIO()
    bar = ProgressCallback(Console(file=out, width=200))
    monkeypatch.setattr(reporting, "PLAIN_LINE_INTERVAL_S", 3600.0)
    bar.on_epoch_begin(args(max_steps=2), state(0, 0.0), None)
    bar.on_log(args(max_steps=2), state(2, 0.2), None, logs={"loss": 0.1, "reward": 0.5})
    bar.on_train_end(args(max_steps=2), state(2), None)
    assert out.getvalue().splitlines()[-1].startswith("train step 2/2  reward 0.500  [")


def test_other_processes_show_nothing():
    out = io.StringIO()
    bar = ProgressCallback(Console(file=out, width=200))
    other_rank = SimpleNamespace(global_step=1, epoch=0.1, is_world_process_zero=False)
    bar.on_epoch_begin(args(max_steps=4), other_rank, None)
    bar.on_log(args(max_steps=4), other_rank, None, logs={"loss": 0.1, "reward": 0.5})
    bar.on_train_end(args(max_steps=4), other_rank, None)
    assert out.getvalue() == ""


def test_the_epoch_bar_stops_at_its_total_and_needs_a_positive_epoch_count():
    assert bar_extent(args(epochs=2), state(9, 2.0004)) == (2.0, 2.0)
    assert bar_extent(args(epochs=0), state(9, 0.5)) == (None, 9.0)


def test_the_status_shows_queue_and_wait_and_an_unscored_eval_omits_its_reward():
    logs = {"perf/step_s": 1.5, "rollout/queue_size": 7.0, "perf/rollout_wait_s": 0.25}
    assert train_status(logs, 0.5) == "reward 0.500  step 1.50s  queue 7  wait 0.25s"
    assert reporting.eval_status({"eval/step": 4.0, "eval/pass@1": 0.5, "eval/reward": math.nan}) == (
        "eval@4 pass@1 0.50")


def test_an_evaluation_keeps_the_train_status_and_logs_after_the_run_print_nothing(monkeypatch):
    out = io.StringIO()
    bar = ProgressCallback(Console(file=out, width=200))
    run_args = args(max_steps=4)
    monkeypatch.setattr(reporting, "PLAIN_LINE_INTERVAL_S", 0.0)
    bar.on_epoch_begin(run_args, state(0, 0.0), None)
    bar.on_log(run_args, state(1, 0.1), None, logs={"loss": 0.1, "reward": 0.5, "perf/step_s": 1.5})
    bar.on_log(run_args, state(1, 0.1), None, logs={"eval/pass@1": 0.75, "eval/step": 1.0})
    bar.on_train_end(run_args, state(1), None)
    printed = out.getvalue()
    bar.on_log(run_args, state(1), None, logs={"eval/pass@1": 0.5, "eval/step": 1.0})  # evaluate()
    assert out.getvalue() == printed
    assert printed.splitlines()[-1].split("  [")[0] == (
        "train step 1/4  reward 0.500  step 1.50s  eval@1 pass@1 0.75")


def test_the_python_trainers_tqdm_bar_has_no_total_when_the_epochs_end_the_run():
    """A Python run without max_steps (the quick start) showed `1/1000000000 [01:12<20173919:
    14:49]`: transformers' bar counted to the Trainer's placeholder step count."""
    from grpo_agent.train.trainer import UNKNOWN_STEPS, StepProgressCallback

    bars = {}
    for max_steps in (UNKNOWN_STEPS, 30):
        callback = StepProgressCallback()
        trainer_state = SimpleNamespace(max_steps=max_steps, is_world_process_zero=True)
        callback.on_train_begin(args(max_steps=-1 if max_steps == UNKNOWN_STEPS else 30),
                                trainer_state, None)
        bars[max_steps] = callback.training_bar
        callback.training_bar.close()
    assert bars[UNKNOWN_STEPS].total is None and "1000000000" not in str(bars[UNKNOWN_STEPS])
    assert bars[30].total == 30


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_the_python_trainer_uses_that_bar(tiny_model_path, tmp_path):
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.train.trainer import StepProgressCallback
    from transformers.trainer_callback import ProgressCallback as TqdmBar

    trainer = AsyncGRPOTrainer(
        str(tiny_model_path), reward_funcs=[_zero_reward], train_dataset=[{"prompt": "2+2?"}],
        args=AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    bars = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TqdmBar)]
    assert [type(cb) for cb in bars] == [StepProgressCallback]


def test_a_run_whose_start_check_refuses_the_server_never_says_it_waits_for_rollouts(
        tiny_model_path, tmp_path, monkeypatch):
    """`train step 0/N  waiting for rollouts` was printed just before the start check's refusal
    (the pipeline starts at train begin, after this callback's): the run never waited."""
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.train import setup

    def refuse(args, model):
        raise ValueError("the start check refuses the server")

    monkeypatch.setattr(setup, "check_server", refuse)
    out = io.StringIO()
    trainer = AsyncGRPOTrainer(
        str(tiny_model_path), reward_funcs=[_zero_reward], train_dataset=[{"prompt": "2+2?"}],
        args=AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2),
        callbacks=[ProgressCallback(Console(file=out, width=200))])
    with pytest.raises(ValueError, match="refuses the server"):
        trainer.train()
    assert out.getvalue() == ""
