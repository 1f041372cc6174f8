"""metrics.jsonl across runs in one output directory: fresh runs start it over, resumes keep
the rows up to their checkpoint, and a line cut short by a killed run is skipped."""
from types import SimpleNamespace

from grpo_agent.train.reporting import METRICS_NAME, JsonlMetricsCallback, read_metrics


def _begin(tmp_path, global_step: int) -> list[dict]:
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(is_world_process_zero=True, global_step=global_step)
    callback = JsonlMetricsCallback()
    callback.on_train_begin(args, state, None)
    callback.on_log(args, SimpleNamespace(is_world_process_zero=True, global_step=global_step + 1),
                    None, logs={"loss": 0.5})
    return read_metrics(tmp_path / METRICS_NAME)


def _previous_run(tmp_path, steps: int) -> None:
    lines = [f'{{"step": {s}, "loss": 1.0}}' for s in range(1, steps + 1)]
    (tmp_path / METRICS_NAME).write_text("\n".join(lines) + '\n{"step": 9, "lo')  # killed mid-line


def test_a_fresh_run_does_not_append_to_an_earlier_runs_rows(tmp_path):
    _previous_run(tmp_path, steps=8)
    assert [row["step"] for row in _begin(tmp_path, global_step=0)] == [1]


def test_a_resume_keeps_the_rows_up_to_its_checkpoint(tmp_path):
    _previous_run(tmp_path, steps=8)
    assert [row["step"] for row in _begin(tmp_path, global_step=5)] == [1, 2, 3, 4, 5, 6]


def test_a_truncated_line_is_skipped_when_reading(tmp_path):
    _previous_run(tmp_path, steps=2)
    assert [row["step"] for row in read_metrics(tmp_path / METRICS_NAME)] == [1, 2]


def test_only_the_main_process_rewrites_or_appends(tmp_path):
    _previous_run(tmp_path, steps=3)
    before = (tmp_path / METRICS_NAME).read_text()
    args = SimpleNamespace(output_dir=str(tmp_path))
    other_rank = SimpleNamespace(is_world_process_zero=False, global_step=0)
    callback = JsonlMetricsCallback()
    callback.on_train_begin(args, other_rank, None)
    callback.on_log(args, other_rank, None, logs={"loss": 0.5})
    assert (tmp_path / METRICS_NAME).read_text() == before


def test_an_empty_window_writes_no_row_and_non_finite_values_are_null(tmp_path):
    import json

    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    callback = JsonlMetricsCallback()
    callback.on_log(args, state, None, logs={})
    callback.on_log(args, state, None, logs={"loss": float("nan"), "reward": float("inf"), "n": 2})

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = (tmp_path / METRICS_NAME).read_text().splitlines()
    assert [json.loads(line, parse_constant=refuse) for line in lines] == [
        {"step": 3, "loss": None, "reward": None, "n": 2}]


def test_a_given_path_is_used_instead_of_the_output_dir(tmp_path):
    path = tmp_path / "elsewhere" / "m.jsonl"
    args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    JsonlMetricsCallback(path).on_log(args, state, None, logs={"loss": 0.5})
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}]
    assert not (tmp_path / "out" / METRICS_NAME).exists()
