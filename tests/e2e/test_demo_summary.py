"""`make demo`'s last lines: held-out success first -> last, read from a run's metrics.jsonl."""
from __future__ import annotations

import json

import pytest


def test_summary_reads_first_and_last_evaluation(tmp_path):
    from grpo_agent.train.reporting import held_out_summary

    rows = [{"step": 1, "eval/pass@1": 2 / 9, "eval/step": 0.0, "eval/num_rows": 9.0},
            {"step": 1, "loss": 0.1, "reward": 0.4},
            {"step": 6, "eval/pass@1": 5 / 9, "eval/step": 5.0, "eval/num_rows": 9.0},
            {"step": 11, "eval/pass@1": 6 / 9, "eval/step": 10.0, "eval/num_rows": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = held_out_summary(tmp_path)
    assert text.startswith("held-out success (eval/pass@1 over 9 eval rows): 0.22 at step 0 -> "
                           "0.67 at step 10")
    assert "step 5: 0.56" in text


def test_summary_of_a_run_without_evaluation_says_how_to_get_one(tmp_path):
    from grpo_agent.train.reporting import held_out_summary

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    with pytest.raises(SystemExit, match="eval_strategy=steps"):
        held_out_summary(tmp_path)


def test_summary_of_a_folder_without_metrics_names_it(tmp_path):
    from grpo_agent.train.reporting import held_out_summary

    with pytest.raises(SystemExit, match="metrics.jsonl does not exist: pass the --output-dir"):
        held_out_summary(tmp_path / "nothing")
