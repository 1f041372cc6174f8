"""`report_to="tensorboard"` through the real trainer (scripted samples and evaluations, no
server): the logged windows, eval/* included, are written as events and read back."""
from __future__ import annotations

import pytest

from tests.train.test_evaluation_schedule import EVAL_SPLIT, run_trainer, scripted_eval  # noqa: F401

pytest.importorskip("tensorboard")


def test_tensorboard_events_hold_every_logged_window_and_the_evaluations(tmp_path, scripted_eval):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = run_trainer(tmp_path, scripted_eval, steps=3, eval_dataset=EVAL_SPLIT,
                          eval_strategy="steps", eval_steps=2, eval_on_start=True,
                          report_to="tensorboard")
    (logdir,) = {path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(logdir)).Reload()
    tags = set(events.Tags()["scalars"])
    logged = [row for row in trainer.state.log_history if "loss" in row]

    def series(tag):
        return [(e.step, pytest.approx(e.value, rel=1e-5)) for e in events.Scalars(tag)]

    assert series("train/loss") == [(row["step"], row["loss"]) for row in logged]
    assert series("train/batch/packing_ratio") == [(row["step"], row["batch/packing_ratio"])
                                                  for row in logged]
    # Evaluations (at start, after step 2, after the last step) land under train/eval/*.
    assert [e.value for e in events.Scalars("train/eval/model_version")] == [0.0, 2.0, 3.0]
    assert {"train/eval/pass@1", "train/eval/reward", "train/perf/eval_push_wait_s"} <= tags
