"""`grpo-agent train --env verifiers --agent verifiers` end to end: the CLI, the rollout worker's
gateway, verifiers' own harness in its venv, a real vLLM server on the tool-warmed tiny model.

No learning claim. The warmed model replies briefly, so the test taskset's brevity reward
varies within a group and groups train; the run must reach max_steps and log the taskset's
weighted rewards. `token_budget` is small so a step needs a few groups, not the ~100 short
samples that fill the server's 4096-token context (that, with a process per episode, is why an
earlier attempt logged nothing in 600 s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_agent_env_verifiers import VerifiersVenvMissing, venv_python

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

TASKSETS = Path(__file__).parent / "tasksets"
MAX_STEPS = 2

try:
    venv_python()
except VerifiersVenvMissing as missing:
    pytest.skip(f"{missing}", allow_module_level=True)


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory):
    """The tool-warmed model's server (the run pushes weights into it; `tool_warmed_server`)."""
    from grpo_agent.testing.warm_server import tool_warmed_server

    with tool_warmed_server(tmp_path_factory.mktemp("vllm-verifiers")) as server:
        yield server


def test_a_verifiers_taskset_trains_through_the_cli(warm_server, tmp_path):
    out, log = tmp_path / "run", tmp_path / "cli.log"
    args = [
        "train", "--env", "verifiers", "--env-arg", "id=grpo_reverse_words", "--agent", "verifiers",
        "--model", str(warm_server.model_path), "--vllm-url", warm_server.base_url,
        "--output-dir", str(out), "--set", f"max_steps={MAX_STEPS}", "--set", "num_generations=2",
        "--set", "max_completion_length=16", "--set", "token_budget=128",
        "--set", "gradient_checkpointing=false", "--set", "optim=adamw_torch",
        "--set", "save_strategy=no", "--set", "logging_steps=1",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(TASKSETS)}
    with open(log, "wb") as sink:
        done = subprocess.run([sys.executable, "-m", "grpo_agent.cli.main", *args], stdout=sink,
                              stderr=subprocess.STDOUT, env=env, timeout=840, check=False)
    assert done.returncode == 0, log.read_text(errors="replace")[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "rewards/rollout/mean" in row]
    assert [row["step"] for row in steps] == list(range(1, MAX_STEPS + 1)), rows
    # exact (weight 1) + brevity (weight 0.5): the taskset's sum, as verifiers computed it
    assert all(0.0 <= row["rewards/rollout/mean"] <= 1.5 for row in steps), steps
    assert all(row["harness/calls_per_rollout"] >= 1 for row in steps), steps
    assert (out / "final" / "config.json").is_file()
