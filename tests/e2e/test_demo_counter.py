"""`make demo`'s claim end to end: its own run raises held-out success on the counter task.

The CLI trains the `counter` env on the counter-warmed tiny model
(`grpo_agent.testing.warmup.build_counter_warmed_model`: it calls `increment` with the target
or the target plus one, and greedy decoding mostly picks the overshoot) against its own CPU vLLM
server, with the settings `make demo` passes (read from the Makefile's DEMO_SETS, so the test
and the demo cannot drift apart), evaluating the env's eval split (targets 1-9, greedy) at the
start and every 5 of the 30 steps.

Margin: the better of the last two evaluations must beat the first by GAIN_MARGIN (3 of the 9
targets). The control cannot reach it: with learning_rate=0 the weights never change and greedy
decoding of one version is deterministic (tests/e2e/test_evaluation.py), so every evaluation
repeats the first one (measured: 0.33 at all 7 evaluations). Learning, measured on 2026-12-05
(docs/quickstart.md): the run starts at 0.44 on this box and, with the demo's learning rate
held for 20 steps then decayed over the last 10, ended at 0.78-1.00 in seven runs (late
entropy <= 0.05). With the rate held constant, runs in the test suite twice ended below +4/9:
a target stuck at 0.78, and a late collapse (grad-norm spikes from step 21, entropy 0.03 ->
0.18, 0.89 at step 15 -> 0.56 at step 30); the decay removes the collapse, not the stuck
target, hence +3/9. The better of the last two is checked because a run can lose the call
format for a step or two (0.00 at one evaluation, seen at a constant rate).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.unit.test_metrics import undocumented

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

GAIN_MARGIN = 3 / 9 - 1e-9
MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def demo_settings() -> list[str]:
    """The `--set` arguments of `make demo`, as the Makefile's DEMO_SETS spells them."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    match = re.search(r"^DEMO_SETS\s*:=(.*)$", text, re.MULTILINE)
    assert match, f"no DEMO_SETS in {MAKEFILE}"
    return shlex.split(match.group(1))


def test_demo_settings_are_read_from_the_makefile():
    args = demo_settings()
    assert args[0::2] == ["--set"] * (len(args) // 2)
    keys = {item.split("=", 1)[0] for item in args[1::2]}
    assert {"max_steps", "learning_rate", "lr_scheduler_type", "num_generations", "eval_steps",
            "seed"} <= keys


def test_demo_run_raises_held_out_success(cli, tmp_path):
    from grpo_agent.testing.warmup import build_counter_warmed_model
    from grpo_agent.train.reporting import read_metrics

    out = tmp_path / "run"
    # A policy that collapses (every group zero-std: seen once in four runs, 2026-12-03) stops
    # with the trainer's own no-progress message in 4 minutes instead of the 840 s timeout.
    args = ["train", "--env", "counter", "--model", str(build_counter_warmed_model()),
            "--output-dir", str(out), *demo_settings(), "--set", "no_progress_timeout=240"]
    cli.run(args, tmp_path / "cli.log", timeout=840)

    evals = [row for row in read_metrics(out / "metrics.jsonl") if "eval/pass@1" in row]
    assert [row["eval/step"] for row in evals] == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
    assert all(row["eval/num_rows"] == 9.0 for row in evals)
    first = evals[0]["eval/pass@1"]
    best_late = max(row["eval/pass@1"] for row in evals[-2:])
    curve = " / ".join(f"{row['eval/pass@1']:.2f}" for row in evals)
    assert first <= 0.5, f"the warmed model starts too high to show learning: {first:.2f}"
    assert best_late - first >= GAIN_MARGIN, f"held-out pass@1 {curve}"
    # `make demo` shows its outcome through the run's own last lines (the Makefile adds none).
    assert (f"held-out success (eval/pass@1 over 9 eval rows): {first:.2f} at step 0 -> "
            in (tmp_path / "cli.log").read_text())
    # Tools, an env's get_reward and evaluations log names the words run does not.
    logged = set().union(*read_metrics(out / "metrics.jsonl"))
    assert not undocumented(logged), f"logged but not in docs/metrics.md: {undocumented(logged)}"
