"""Eval rows in the run's outputs: the plot's third panel and the progress bar's eval note."""
from __future__ import annotations

import json

from grpo_agent.train import reporting


def test_the_plot_gets_an_eval_panel_over_the_evaluated_steps(tmp_path, monkeypatch):
    rows = [{"step": 1, "loss": 0.1, "reward": 0.2, "completions/mean_length": 5.0},
            {"step": 1, "eval/reward": 0.4, "eval/pass@1": 0.5, "eval/pass@4": 0.75, "eval/step": 0},
            {"step": 2, "loss": 0.1, "reward": 0.3, "completions/mean_length": 6.0},
            {"step": 2, "eval/reward": 0.6, "eval/pass@1": 0.7, "eval/pass@4": 0.9, "eval/step": 2}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}
    inner = reporting.plot_eval_panel

    def record(ax, evals):
        drawn["lines"] = None
        inner(ax, evals)
        drawn["lines"] = {line.get_label(): list(zip(*line.get_data())) for line in ax.get_lines()}

    monkeypatch.setattr(reporting, "plot_eval_panel", record)
    out = reporting.plot_reward_and_length(metrics, tmp_path / "reward.png")
    assert out.stat().st_size > 0
    assert drawn["lines"] == {"reward": [(0, 0.4), (2, 0.6)], "pass@1": [(0, 0.5), (2, 0.7)],
                              "pass@4": [(0, 0.75), (2, 0.9)]}


def test_a_run_without_evaluation_keeps_two_panels(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 0.1, "reward": 0.2}) + "\n")
    monkeypatch.setattr(reporting, "plot_eval_panel", lambda ax, evals: 1 / 0)
    assert reporting.plot_reward_and_length(metrics, tmp_path / "reward.png").is_file()


def test_the_progress_bar_notes_the_last_evaluation():
    assert reporting.eval_status({"eval/step": 4.0, "eval/pass@1": 0.5, "eval/reward": 0.25}) == (
        "eval@4 pass@1 0.50 reward 0.250")


def test_coinciding_eval_series_stay_visible(tmp_path):
    """A 0/1 reward makes eval/reward equal eval/pass@1 (the counter demo): the two lines must
    differ in style, or the one drawn last hides the other and its legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    reporting.plot_eval_panel(ax, [{"step": 1, "eval/step": 0, "eval/reward": 0.3, "eval/pass@1": 0.3},
                                   {"step": 4, "eval/step": 3, "eval/reward": 0.8, "eval/pass@1": 0.8}])
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker(), line.get_linewidth())
              for line in ax.get_lines()}
    plt.close("all")
    assert set(styles) == {"reward", "pass@1"}
    assert styles["reward"] != styles["pass@1"]


def test_an_eval_row_without_eval_step_is_drawn_at_its_logged_step():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    reporting.plot_eval_panel(ax, [{"step": 5, "eval/pass@1": 0.5}])
    lines = {line.get_label(): list(zip(*line.get_data())) for line in ax.get_lines()}
    plt.close("all")
    assert lines == {"pass@1": [(5, 0.5)]}


def test_log_completions_prints_up_to_the_limit_split_at_the_first_trained_token(capsys, monkeypatch):
    from types import SimpleNamespace

    from grpo_agent.types import TrainingSample, TrainingSequence

    monkeypatch.setenv("COLUMNS", "2000")  # one table row a line: no wrapping
    tokenizer = SimpleNamespace(decode=lambda ids: "".join(f"<{i}>" for i in ids))

    def sample(ids, mask, advantage):
        return TrainingSample(TrainingSequence(ids, mask, [0.0] * len(ids)), advantage=advantage,
                              model_version=0, group_id=0, row_index=0)

    long_prompt = list(range(100, 170))  # 350 characters decoded
    samples = [sample([1, 2, 3, 4], [0, 0, 1, 1], 0.5), sample(long_prompt + [9], [0] * 70 + [1], -1.25),
               sample([7, 8], [0, 0], 2.0)]
    reporting.print_completions(samples, tokenizer, 2, step=6)
    out = capsys.readouterr().out
    assert "completions at step 6" in out
    assert "<1><2>" in out and "<3><4>" in out and "<2><3>" not in out  # split at the first 1
    assert "+0.500" in out and "-1.250" in out and "+2.000" not in out  # at most `limit` rows
    assert "<169>" in out and "<130>" in out and "<129>" not in out  # the prompt's last 200 chars
    reporting.print_completions(samples, tokenizer, None, step=7)
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "+2.000" in line]  # no limit: every sample
    assert [cell.strip() for cell in row.split("│")[1:4]] == ["<7><8>", "", "+2.000"]  # untrained
    reporting.print_completions(samples, tokenizer, 0, step=8)
    assert "+0.500" not in capsys.readouterr().out  # a limit of 0 prints no row
