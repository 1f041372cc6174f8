"""A run's summary (`make demo`'s last lines, `grpo-agent train`'s end, `python -m
grpo_agent.train.reporting RUN`): the training reward first -> last and held-out success."""
from __future__ import annotations

import json
import runpy
import sys

import pytest


def write_rows(folder, rows):
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_reads_first_and_last_evaluation(tmp_path):
    from grpo_agent.train.reporting import run_summary

    rows = [{"step": 1, "eval/pass@1": 2 / 9, "eval/step": 0.0, "eval/num_rows": 9.0},
            {"step": 1, "loss": 0.1, "reward": 0.4},
            {"step": 6, "eval/pass@1": 5 / 9, "eval/step": 5.0, "eval/num_rows": 9.0},
            {"step": 11, "eval/pass@1": 6 / 9, "eval/step": 10.0, "eval/num_rows": 9.0}]
    write_rows(tmp_path, rows)
    lines = run_summary(tmp_path).splitlines()
    assert lines[1] == ("held-out success (eval/pass@1 over 9 eval rows): 0.22 at step 0 -> "
                        "0.67 at step 10")
    assert "step 5: 0.56" in lines[2]


def test_summary_of_a_run_without_evaluation_gives_the_training_reward(tmp_path):
    """A run trained without eval_strategy: its reward's first and last windows (5 rows each),
    with the steps they cover, and how to measure held-out success."""
    from grpo_agent.train.reporting import run_summary, write_run_record

    rows = [{"step": s, "loss": 0.1, "reward": 0.1 * (s <= 6) + 0.8 * (s > 7)} for s in range(1, 13)]
    rows[0]["reward"] = None  # a window that scored no rollout (NaN, written as null): left out
    rows.append({"step": 12, "train_runtime": 3.0})  # the summary row has no reward
    write_rows(tmp_path, rows)
    write_run_record(tmp_path, "counter", {}, eval_split=True)
    text = run_summary(tmp_path)
    first, held_out = text.splitlines()
    assert first == ("training reward (mean `reward` of the logged windows): 0.100 over steps "
                     "2-6 -> 0.800 over steps 8-12 (+0.700)")
    assert held_out.startswith("held-out success: not measured")
    assert "--set eval_strategy=steps" in held_out
    assert f"grpo-agent eval --env counter --model {tmp_path / 'final'}" in held_out
    write_run_record(tmp_path, "words", {}, eval_split=False)
    no_split = run_summary(tmp_path).splitlines()[1]
    assert "declares no eval split" in no_split and "eval_strategy" not in no_split


def test_reward_windows_span_the_steps_since_the_previous_window(tmp_path):
    """logging_steps=2: a row at step 4 covers steps 3-4; a short run's windows do not overlap."""
    from grpo_agent.train.reporting import reward_windows, training_reward_summary

    rows = [{"step": s, "loss": 0.0, "reward": s / 10} for s in (2, 4, 6)]
    assert reward_windows(rows) == ((1, 2, 0.2), (5, 6, 0.6))
    assert training_reward_summary(rows[:1]) == (
        "training reward (mean `reward`): 0.200 at steps 1-2, the only window")
    assert training_reward_summary([{"step": 1, "loss": 0.0, "reward": None}]) == (
        "training reward: no logged training window scored a rollout.")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, harmless
def test_reporting_module_prints_the_summary_and_refuses_a_missing_folder(tmp_path, monkeypatch,
                                                                          capsys):
    """`python -m grpo_agent.train.reporting RUN`, run in-process (a subprocess costs seconds of
    imports)."""
    write_rows(tmp_path, [{"step": 1, "loss": 0.1, "reward": 0.25},
                          {"step": 2, "loss": 0.1, "reward": 0.75}])

    def main(*args):
        monkeypatch.setattr(sys, "argv", ["reporting", *args])
        runpy.run_module("grpo_agent.train.reporting", run_name="__main__")

    main(str(tmp_path))
    assert capsys.readouterr().out.startswith(
        "training reward (mean `reward` of the logged windows): 0.250 over step 1 -> 0.750 over "
        "step 2 (+0.500)\n")
    with pytest.raises(SystemExit, match="metrics.jsonl does not exist: pass the --output-dir"):
        main(str(tmp_path / "nothing"))
    with pytest.raises(SystemExit, match="^usage: python -m grpo_agent.train.reporting OUTPUT_DIR"):
        main()


def test_summary_of_a_folder_without_metrics_names_it(tmp_path):
    from grpo_agent.train.reporting import run_summary

    with pytest.raises(SystemExit, match="metrics.jsonl does not exist: pass the --output-dir"):
        run_summary(tmp_path / "nothing")
