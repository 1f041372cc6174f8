"""What a CLI run leaves behind and shows: metrics.jsonl, a live progress line, a plot.

These are ordinary `TrainerCallback`s, so a Python user gets the same files by adding them;
the JSONL holds every logged window exactly as `Trainer.log` saw it (one object per line, the
step included), which is what the e2e tests and the plot read.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "reward.png"


class JsonlMetricsCallback(TrainerCallback):
    """Appends each logged window to `<output_dir>/metrics.jsonl` (main process only).

    At train begin the file keeps only the rows of steps the run starts from: none for a fresh
    run in a used output directory (its plot would otherwise mix two runs), the steps up to the
    checkpoint for a resume (rows of steps after it were lost with the killed run)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None

    def _path(self, args) -> Path:
        return self.path or Path(args.output_dir) / METRICS_NAME

    def on_train_begin(self, args, state, control, **kwargs):
        path = self._path(args)
        if not state.is_world_process_zero or not path.is_file():
            return
        kept = [row for row in read_metrics(path) if row.get("step", 0) <= state.global_step]
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        path = self._path(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}}
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ProgressCallback(TrainerCallback):
    """One rich progress bar: steps, reward, step time and queue state."""

    def __init__(self) -> None:
        self._progress = None
        self._task = None
        self._started = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        total = args.max_steps if args.max_steps > 0 else None
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=state.global_step, status="waiting for rollouts")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._progress is None or not logs or "loss" not in logs:
            return
        status = (
            f"reward {logs.get('reward', float('nan')):.3f}  step {logs.get('perf/step_s', float('nan')):.2f}s"
            f"  queue {logs.get('rollout/queue_size', float('nan')):.0f}"
            f"  wait {logs.get('perf/rollout_wait_s', float('nan')):.2f}s"
        )
        self._progress.update(self._task, completed=state.global_step, status=status)

    def on_train_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def read_metrics(path: str | Path) -> list[dict]:
    """The logged rows; a line cut short by a killed run is skipped, not an error."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_reward_and_length(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Reward and mean completion length against the step, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "loss" in r]
    fig, (ax_reward, ax_length) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for ax, key, label in (
        (ax_reward, "reward", "reward (all scored rollouts)"),
        (ax_length, "completions/mean_length", "mean completion length (tokens)"),
    ):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_length.set_xlabel("optimizer step")
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def print_completions(samples: list, tokenizer, limit: int | None, step: int) -> None:
    """`log_completions`: a rich table of the last step's samples (prompt, completion, advantage)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"completions at step {step}", show_lines=True)
    for column in ("prompt", "completion", "advantage"):
        table.add_column(column)
    for sample in samples[:limit] if limit is not None else samples:
        ids, mask = sample.sequence.token_ids, sample.sequence.trained_mask
        start = mask.index(1) if 1 in mask else len(ids)
        table.add_row(tokenizer.decode(ids[:start])[-200:], tokenizer.decode(ids[start:]),
                      f"{sample.advantage:+.3f}")
    Console().print(table)
