"""`make demo`'s claim end to end: a short GRPO run raises held-out success on the counter task.

The CLI trains the `counter` env on the counter-warmed tiny model
(`grpo_agent.testing.warmup.build_counter_warmed_model`: it calls `increment` with the target
or the target plus one, and greedy decoding mostly picks the overshoot) against its own CPU vLLM
server, and evaluates the env's eval split (targets 1-9, greedy) at the start and every 5 steps.

Margin: the last `eval/pass@1` must beat the first by GAIN_MARGIN (3 of the 9 targets). The
control cannot reach it: with learning_rate=0 the weights never change and greedy decoding of
one version is deterministic (tests/e2e/test_evaluation.py), so every evaluation of the control
repeats the first one: measured 0.22 at all 5 evaluations of a 20-step lr=0 run, and this
test's assertions fail on that run's metrics. Seed noise, measured with seeds 1, 2 and 3 of the
`make demo` settings (20 steps): all three went 0.22 -> 0.67 by step 10 (+0.44, 2 targets above
the margin), step 5 varied 0.44-0.56 (docs/quickstart.md), on a script-built model of the same
recipe. With `build_counter_warmed_model`'s own model (which starts at 0.33), seeds 1, 2 and 3
all went 0.33 -> 0.67 by step 10 (+3/9: exactly the margin, no target to spare), the control
stayed at 0.33, and this test passed in 55 s on a quiet box.
"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

GAIN_MARGIN = 3 / 9 - 1e-9
# The first `make demo` settings (8 generations, learning_rate 1e-4), shortened to 10 steps: the
# margin was measured on them; `make demo` now runs 16 generations at 3e-4 for 30 steps.
DEMO_SETS = [
    "max_steps=10", "learning_rate=0.0001", "num_generations=8", "max_completion_length=32",
    "max_tool_calling_iterations=2", 'chat_template_kwargs={"enable_thinking": false}',
    "gradient_checkpointing=false", "optim=adamw_torch", "save_strategy=no", "seed=1",
    "logging_steps=1", "eval_strategy=steps", "eval_steps=5", "eval_on_start=true",
]


def test_short_counter_run_raises_held_out_success(cli, tmp_path):
    from grpo_agent.testing.warmup import build_counter_warmed_model
    from grpo_agent.train.reporting import read_metrics

    out = tmp_path / "run"
    args = ["train", "--env", "counter", "--model", str(build_counter_warmed_model()),
            "--output-dir", str(out)]
    for item in DEMO_SETS:
        args += ["--set", item]
    cli.run(args, tmp_path / "cli.log", timeout=1200)

    evals = [row for row in read_metrics(out / "metrics.jsonl") if "eval/pass@1" in row]
    assert [row["eval/step"] for row in evals] == [0.0, 5.0, 10.0]
    assert all(row["eval/num_rows"] == 9.0 for row in evals)
    first, last = evals[0]["eval/pass@1"], evals[-1]["eval/pass@1"]
    assert first <= 0.5, f"the warmed model starts too high to show learning: {first:.2f}"
    assert last - first >= GAIN_MARGIN, f"held-out pass@1 {first:.2f} -> {last:.2f}"
