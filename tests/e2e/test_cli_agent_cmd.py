"""`grpo-agent train --agent-cmd` end to end: a shell agent with curl trains through the CLI.

The CLI runs as a subprocess against a real vLLM server; each rollout runs the script under
the command sandbox (its only network is the relay to the gateway), and the env's reward
functions score what it generated.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")),
                                 reason="the shell agent needs curl and jq")]

AGENT = Path(__file__).parents[1] / "agent" / "words_curl_agent.sh"


def test_agent_cmd_trains_a_shell_agent_from_the_cli(cli, private_server, tmp_path):
    out = tmp_path / "run"
    cli.run(["train", "--env", "words", "--output-dir", str(out), "--vllm-url", private_server.base_url,
             "--agent-cmd", f"/bin/sh {AGENT}",
             "--set", "max_steps=2", "--set", "num_generations=4", "--set", "max_completion_length=16",
             "--set", "gradient_checkpointing=false", "--set", "optim=adamw_torch",
             "--set", "save_strategy=no", "--set", "learning_rate=0.0001",
             "--set", "token_budget=256"],  # steps of a few groups
            tmp_path / "cli.log", timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2, rows
    assert all(r["num_tokens"] > 0 for r in steps)  # samples from the agent's calls were trained
    assert any("rewards/letter_fraction/mean" in r for r in rows)  # the env's reward scored them
    calls = [r["harness/calls_per_rollout"] for r in rows if "harness/calls_per_rollout" in r]
    assert calls and min(calls) == 1.0  # one gateway call per run of the script
    errors = [r.get("harness/errors_count", 0) for r in rows]
    assert sum(errors) == 0, (tmp_path / "cli.log").read_text()[-4000:]
