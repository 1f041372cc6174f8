"""The spec's quick-start script runs with only its import line, model and dataset changed.

It keeps every default, so it talks to http://localhost:8000 and asks for 2048-token
completions: the private server listens there with max_model_len 4096. Accuracy on a random
tiny model is 0 for every rollout, so every group is dropped (zero reward std) and the run ends
when its 3 epochs of prompts are consumed: the point is that the unmodified script runs to the
end and writes its checkpoint state, not that it learns (the demo test shows learning). The
rewards must really be scored, though: a group whose reward function raised is dropped too,
which is how the run looked while accuracy_reward raised in the scorer threads. A reward that
never scores 1.0 cannot show here (the random model never writes \\boxed{}):
tests/rollout/test_worker_vllm.py scores boxed answers through the same worker threads.
When port 8000 is taken the script gets the private server's URL in `args` instead of skipping.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_agent.train.checkpoint import LEDGER_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("quickstart") / "train_async_grpo.py"
PROMPTS = 1


def write_deepmath_like(path: Path) -> None:
    """Rows with DeepMath-103K's columns: conversational `prompt` and `solution`."""
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}? Answer in \\boxed{{}}."}],
         "solution": str(2 * a)}
        for a in range(1, PROMPTS + 1)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def logged_metrics(stdout: str) -> list[dict[str, float]]:
    """The step logs the trainer printed (dict reprs with a 'loss' key; tqdm shows floats as
    strings, the plain printer as numbers)."""
    value = r"'?([-+0-9.eE]+|nan|inf)'?"
    return [{key: float(number) for key, number in re.findall(rf"'([^']+)': {value}", line)}
            for line in stdout.splitlines() if line.startswith("{") and "'loss'" in line]


def script_text(model_path: str, base_url: str) -> str:
    """The quick-start script for `model_path`; a server off the default port (8000 was taken,
    e.g. by another suite on the machine) is named in the one config field that differs, since
    skipping left the quick start's reward untested on busy machines."""
    text = SCRIPT.read_text().replace("TINY_MODEL_PATH", model_path)
    if not base_url.endswith(":8000"):
        out = f"{Path(model_path).name}-AsyncGRPO"  # the default output_dir of args=None
        text = text.replace("import AsyncGRPOTrainer\n", "import AsyncGRPOConfig, AsyncGRPOTrainer\n")
        text = text.replace("train_dataset=dataset,\n", "train_dataset=dataset,\n        args=AsyncGRPO"
                            f"Config(output_dir={out!r}, vllm_server_base_url={base_url!r}),\n")
        assert base_url in text, "the script's trainer call changed: update script_text"
    return text


def test_spec_quickstart_script_runs_unmodified(private_server, tiny_model_path, tmp_path):
    script = tmp_path / "train_async_grpo.py"
    script.write_text(script_text(str(tiny_model_path), private_server.base_url))
    write_deepmath_like(tmp_path / "deepmath.jsonl")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = tmp_path / f"{Path(tiny_model_path).name}-AsyncGRPO"
    ledger = [json.loads(line) for line in (out / LEDGER_NAME).read_text().splitlines()]
    assert ledger[-1]["frontier"] >= 3 * PROMPTS  # num_train_epochs=3 counted in prompts
    logs = logged_metrics(proc.stdout)
    assert logs, proc.stdout[-3000:]
    assert sum(log.get("rollout/reward_error_count", 0.0) for log in logs) == 0, logs
    scored = [log["rewards/accuracy_reward/mean"] for log in logs
              if "rewards/accuracy_reward/mean" in log]
    assert scored and all(0.0 <= value <= 1.0 for value in scored), logs  # NaN fails too
