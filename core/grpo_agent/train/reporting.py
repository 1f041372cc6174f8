"""What a CLI run leaves behind and shows: metrics.jsonl, a live progress line, a plot.

These are ordinary `TrainerCallback`s, so a Python user gets the same files by adding them;
the JSONL holds every logged window exactly as `Trainer.log` saw it (one object per line, the
step included), which is what the e2e tests and the plot read.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "reward.png"
RUN_RECORD_NAME = "run.json"
# Off a terminal, a step's progress line goes out at most this often (evaluations always).
PLAIN_LINE_INTERVAL_S = 30.0


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
    """One rich progress bar: steps (of `max_steps`, or the run's prompt epochs), the last known
    reward, step time, queue state and the last evaluation. When the output is not a terminal
    (a log file, a batch job) a live bar shows nothing until the end, so the same text goes out
    as plain lines instead: every evaluation, and a step at most every `PLAIN_LINE_INTERVAL_S`.
    Nothing shows before the first epoch begins, where the run starts waiting for rollouts:
    the pipeline's start check runs at train begin after this callback's, and "waiting for
    rollouts" was printed just before its refusal of the server."""

    def __init__(self, console=None) -> None:
        """`console`: a `rich.console.Console` to write to (default: stdout's)."""
        self._console = console
        self._progress = None
        self._task = None
        self._plain = False
        self._line_at: float | None = None  # when the last plain line went out
        self._line = ""  # the last plain line's text, printed once more at the end if newer
        self._started = time.perf_counter()
        self._train_status = "waiting for rollouts"
        self._eval_status = ""  # the last evaluation, kept beside the training status
        self._last_reward: float | None = None  # a window without a scored rollout keeps it

    def on_epoch_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self._plain or self._progress is not None:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._console = self._console or Console()
        if not self._console.is_terminal:
            self._plain = True
            self._print_line(args, state)
            return
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), TextColumn("{task.fields[position]}"),
            TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=self._console,
        )
        self._progress.start()
        total, completed = bar_extent(args, state)
        self._task = self._progress.add_task(
            "train", total=total, completed=completed, position=position_text(args, state),
            status=self._train_status)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        evaluated = "eval/pass@1" in logs
        if evaluated:
            self._eval_status = eval_status(logs)
        if "loss" in logs:
            reward = logs.get("reward")
            if reward is not None and math.isfinite(reward):
                self._last_reward = reward
            self._train_status = train_status(logs, self._last_reward)
        if self._progress is None and not self._plain:  # not shown (yet, or any more)
            return
        if self._plain:
            if evaluated or time.perf_counter() - self._line_at >= PLAIN_LINE_INTERVAL_S:
                self._print_line(args, state)
            return
        total, completed = bar_extent(args, state)
        self._progress.update(self._task, total=total, completed=completed,
                              position=position_text(args, state),
                              status=f"{self._train_status}  {self._eval_status}".rstrip())

    def on_train_end(self, args, state, control, **kwargs):
        if self._plain and self._line != self._text(args, state):
            self._print_line(args, state)  # the final state, if throttling held it back
        self._plain = False
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _text(self, args, state) -> str:
        return f"train {position_text(args, state)}  {self._train_status}  {self._eval_status}".rstrip()

    def _print_line(self, args, state) -> None:
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.perf_counter() - self._started))
        self._line, self._line_at = self._text(args, state), time.perf_counter()
        self._console.print(f"{self._line}  [{elapsed}]", highlight=False, markup=False,
                            soft_wrap=True)


def quiet_library_bars_off_terminal() -> None:
    """transformers', huggingface_hub's and datasets' tqdm bars ("Loading weights", "Writing
    model shards", downloads, "Map") follow `ProgressCallback`'s rule: off a terminal (a CI log,
    a file) each bar's redraws land in the log as one long line, so they are turned off when
    stderr, where tqdm writes, is no terminal; on a terminal they stay.
    HF_HUB_DISABLE_PROGRESS_BARS and HF_DATASETS_DISABLE_PROGRESS_BARS, when set, are the
    user's choice and win."""
    if sys.stderr.isatty():
        return
    if "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ:
        from datasets.utils import disable_progress_bars

        disable_progress_bars()


def bar_extent(args, state) -> tuple[float | None, float]:
    """(total, completed): steps of `max_steps`; else the prompt epochs the run has consumed
    (a step's size in prompts is not known in advance, its epochs are); else unknown."""
    if args.max_steps > 0:
        return float(args.max_steps), float(state.global_step)
    if args.num_train_epochs > 0 and state.epoch is not None:
        return float(args.num_train_epochs), min(float(state.epoch), float(args.num_train_epochs))
    return None, float(state.global_step)


def position_text(args, state) -> str:
    """`step 3/10`, or `step 3  epoch 0.40/1` when epochs bound the run."""
    if args.max_steps > 0:
        return f"step {state.global_step}/{args.max_steps}"
    if state.epoch is not None:
        return f"step {state.global_step}  epoch {state.epoch:.2f}/{args.num_train_epochs:g}"
    return f"step {state.global_step}"


def train_status(logs: dict, last_reward: float | None) -> str:
    """Reward (the last known one when this window scored no rollout), step time, queue, wait."""
    nan = float("nan")
    reward = "reward -" if last_reward is None else f"reward {last_reward:.3f}"
    parts = [reward]
    for key, label, fmt in (("perf/step_s", "step", "{:.2f}s"), ("rollout/queue_size", "queue", "{:.0f}"),
                            ("perf/rollout_wait_s", "wait", "{:.2f}s")):
        value = logs.get(key, nan)
        if value is not None and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


def eval_status(logs: dict) -> str:
    """The progress bar's note of the last evaluation: pass@1, reward and the step evaluated."""
    text = f"eval@{logs.get('eval/step', 0):.0f} pass@1 {logs['eval/pass@1']:.2f}"
    reward = logs.get("eval/reward")
    return text if reward is None or not math.isfinite(reward) else f"{text} reward {reward:.3f}"


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

    all_rows = read_metrics(metrics_path)
    rows = [r for r in all_rows if "loss" in r]
    evals = [r for r in all_rows if r.get("eval/reward") is not None or r.get("eval/pass@1") is not None]
    panels = 3 if evals else 2
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3 * panels), sharex=True)
    ax_reward, ax_length = axes[0], axes[1]
    for ax, key, label in (
        (ax_reward, "reward", "reward (all scored rollouts)"),
        (ax_length, "completions/mean_length", "mean completion length (tokens)"),
    ):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if evals:
        plot_eval_panel(axes[2], evals)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_eval_panel(ax, evals: list[dict]) -> None:
    """Held-out eval/* against the step whose weights were evaluated (`eval/step`). The reward is
    a wide solid line and each pass@k a thin dashed one on top: with a 0/1 reward they coincide
    (the counter demo), and both must stay visible."""
    keys = ["eval/reward", "eval/pass@1"] + sorted(
        {k for r in evals for k in r if k.startswith("eval/pass@") and k != "eval/pass@1"})
    for key in keys:
        points = [(r.get("eval/step", r["step"]), r[key]) for r in evals if r.get(key) is not None]
        style = ({"marker": "o", "markersize": 9, "linewidth": 4, "alpha": 0.5}
                 if key == "eval/reward" else {"marker": "x", "linestyle": "--"})
        if points:
            ax.plot(*zip(*points), label=key.removeprefix("eval/"), **style)
    ax.set_ylabel("held-out eval")
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)


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


# The training-reward summary compares the mean of the first and of the last this many logged
# windows (fewer when the run logged under twice as many, so the two never overlap).
REWARD_WINDOW_ROWS = 5
Window = tuple[int, int, float]  # first step, last step, mean `reward`


def reward_points(rows: list[dict]) -> list[Window]:
    """(first step, last step, `reward`) of each training window (a row with `loss`) that scored
    a rollout; a window spans the steps since the previous training row (`logging_steps`)."""
    points, start = [], 1
    for row in rows:
        if "loss" not in row:
            continue
        if row.get("reward") is not None:
            points.append((start, int(row["step"]), float(row["reward"])))
        start = int(row["step"]) + 1
    return points


def reward_windows(rows: list[dict], size: int = REWARD_WINDOW_ROWS) -> tuple[Window, Window] | None:
    """The first and the last `size` scored windows (fewer for a short run), each as
    (first step, last step, mean `reward`); None when no window scored a rollout."""
    points = reward_points(rows)
    if not points:
        return None
    n = max(1, min(size, len(points) // 2))

    def window(part: list[Window]) -> Window:
        return part[0][0], part[-1][1], sum(p[2] for p in part) / len(part)

    return window(points[:n]), window(points[-n:])


def _steps(first: int, last: int) -> str:
    return f"step {last}" if first == last else f"steps {first}-{last}"


def training_reward_summary(rows: list[dict]) -> str:
    """Mean training `reward` over the first and the last logged windows, with their steps."""
    windows = reward_windows(rows)
    if windows is None:
        return "training reward: no logged training window scored a rollout."
    (a0, a1, first), (b0, b1, last) = windows
    if (a0, a1) == (b0, b1):
        return f"training reward (mean `reward`): {first:.3f} at {_steps(a0, a1)}, the only window"
    return (f"training reward (mean `reward` of the logged windows): {first:.3f} over "
            f"{_steps(a0, a1)} -> {last:.3f} over {_steps(b0, b1)} ({last - first:+.3f})")


def held_out_summary(rows: list[dict]) -> str | None:
    """Held-out success (`eval/pass@1`) at each evaluation, first and last side by side; None
    for a run that never evaluated."""
    evals = [row for row in rows if "eval/pass@1" in row]
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    trail = ", ".join(f"step {int(r['eval/step'])}: {r['eval/pass@1']:.2f}" for r in evals)
    return (f"held-out success (eval/pass@1 over {int(first['eval/num_rows'])} eval rows): "
            f"{first['eval/pass@1']:.2f} at step {int(first['eval/step'])} -> "
            f"{last['eval/pass@1']:.2f} at step {int(last['eval/step'])}\n  ({trail})")


def write_run_record(output_dir: str | Path, env: str, env_args: dict[str, Any],
                     eval_split: bool) -> None:
    """`run.json`: the env a run trained, the options it was given and whether the env declares
    an eval split, so its summary reprinted later gives the run's own advice on evaluating."""
    record = {"env": env, "env_args": env_args, "eval_split": eval_split}
    (Path(output_dir) / RUN_RECORD_NAME).write_text(json.dumps(record) + "\n")


def env_flags(env: str, options: dict[str, Any]) -> str:
    """The run's env and the options it was given, as `grpo-agent eval` takes them."""
    import shlex

    flags = ["--env", env]
    for key, value in options.items():
        flags += ["--env-arg", f"{key}={value}"]
    return shlex.join(flags)


def run_summary(output_dir: str | Path) -> str:
    """What a run did, from its metrics.jsonl: the training reward first -> last and, when it
    evaluated, held-out success (what judges it: docs/evaluation.md), else how to measure that,
    for the env and options in its run.json (`--env ENV` for a run without one: a Python
    `AsyncGRPOTrainer` run, which `grpo-agent train` did not start)."""
    out = Path(output_dir)
    metrics = out / METRICS_NAME
    if not metrics.is_file():
        raise SystemExit(f"{metrics} does not exist: pass the --output-dir of a run.")
    rows = read_metrics(metrics)
    record = _read_run_record(out)
    flags, eval_split = ((env_flags(record["env"], record["env_args"]), record["eval_split"])
                         if record else (None, None))
    lines = [training_reward_summary(rows),
             held_out_summary(rows) or _not_evaluated(out, flags, eval_split)]
    if (out / PLOT_NAME).is_file():
        lines.append(f"plot: {out / PLOT_NAME}")
    return "\n".join(lines)


def _read_run_record(out: Path) -> dict[str, Any] | None:
    path = out / RUN_RECORD_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def _not_evaluated(out: Path, flags: str | None, eval_split: bool | None) -> str:
    text = "held-out success: not measured (a rising training reward is not held-out success)"
    if eval_split is False:
        return (f"{text}; the env declares no eval split: pass eval_dataset= to "
                "AsyncGRPOTrainer, or declare one with @environment(..., eval_dataset=...) "
                "(docs/evaluation.md).")
    final, env = out / "final", flags or "--env ENV"
    if (final / "adapter_config.json").is_file() and not (final / "config.json").is_file():
        # a LoRA run saves the adapter alone, which `grpo-agent eval` cannot serve (it said
        # to run it on this folder, and eval refused it)
        return (f"{text}. Train with --set eval_strategy=steps --set eval_on_start=true, or "
                f"merge the LoRA adapter in {final} into its base model (peft merge_and_unload, "
                f"then save_pretrained to a folder MERGED) and run `grpo-agent eval {env} "
                "--model MERGED` (docs/evaluation.md).")
    return (f"{text}. Train with --set eval_strategy=steps --set eval_on_start=true, or run "
            f"`grpo-agent eval {env} --model {final}` (docs/evaluation.md).")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m grpo_agent.train.reporting OUTPUT_DIR (a run's --output-dir)")
    print(run_summary(sys.argv[1]))
