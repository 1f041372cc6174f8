"""`grpo-agent train` end to end: the CLI as a subprocess against a real vLLM server.

- The demo task learns: the mean reward of the last windows beats the first ones by at least
  LEARNING_MARGIN, a margin the same run with learning_rate=0 does not produce (measured in
  docs/quickstart.md), every metric family of the spec is in metrics.jsonl, and every
  name it logs is in docs/metrics.md.
- SIGKILL mid-run, then resume: across the two runs no prompt is trained twice and every
  prompt below the final resume point was trained or reported consumed.
- The agent path: the trainer with `tools=[...]` trains and logs the tool metrics.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_agent.train.checkpoint import last_complete_checkpoint
from grpo_agent.train.reporting import reward_windows

from tests.unit.test_metrics import undocumented

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

LEARNING_MARGIN = 0.3
# The demo's settings (the Makefile's `make demo-words` uses the same, over the whole dataset). The run
# ends by prompt epochs, not max_steps: once the task saturates every group is dropped, and only
# the prompt count still moves.
DEMO_SETS = [
    "num_train_epochs=0.5", "learning_rate=0.0003", "num_generations=8",
    "max_completion_length=16", "gradient_checkpointing=false", "optim=adamw_torch",
    "save_strategy=no", "seed=1",
]
# One representative per family the spec lists (names exactly as the spec writes them).
SPEC_METRIC_FAMILIES = [
    "reward", "reward_group_std", "frac_reward_zero_std", "num_tokens", "entropy",
    "completions/mean_length", "rewards/letter_fraction/mean",
    "sampling/importance_sampling_ratio/mean", "clip_ratio/region_mean",
    "rollout/generated_tokens_per_s", "rollout/concurrency_cap", "rollout/queue_size",
    "sample/staleness_mean", "sample/forwarded_tokens_mean",
    "batch/packing_ratio", "batch/forwarded_tokens_per_step",
    "perf/step_s", "perf/fwd_bwd_s", "perf/optimizer_s", "perf/rollout_wait_s",
    "perf/weight_sync_s", "perf/weight_sync_transfer_s",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_demo_run_improves_reward_and_logs_every_metric_family(cli, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--env", "words", "--output-dir", str(out)]
    for item in DEMO_SETS:
        args += ["--set", item]
    cli.run(args, tmp_path / "cli.log", timeout=900)  # embedded: starts and stops its server

    rows = read_jsonl(out / "metrics.jsonl")
    logs = [r for r in rows if "loss" in r]
    assert len(logs) >= 12
    # The first and last 5 scored windows, as the run's summary compares them.
    (_, _, first), (_, _, last) = reward_windows(rows)
    assert last - first >= LEARNING_MARGIN, f"reward {first:.3f} -> {last:.3f}"
    # This run did not evaluate (`words` declares no eval split): its last lines still say
    # whether the training reward rose, and that held-out success was not measured.
    log = (tmp_path / "cli.log").read_text()
    assert f"training reward (mean `reward` of the logged windows): {first:.3f} over steps" in log
    assert "held-out success: not measured" in log and "declares no eval split" in log
    missing = [name for name in SPEC_METRIC_FAMILIES if not any(name in r for r in logs)]
    assert not missing, f"metrics.jsonl lacks {missing}"
    logged = set().union(*rows)
    assert not undocumented(logged), f"logged but not in docs/metrics.md: {undocumented(logged)}"
    assert (out / "reward.png").stat().st_size > 1000
    assert (out / "final" / "config.json").is_file()


def _ledger_runs(path: Path) -> list[list[dict]]:
    """Split prompt_ledger.jsonl into runs (one trainer process each)."""
    runs: list[list[dict]] = []
    for record in read_jsonl(path):
        if not runs or record["pid"] != runs[-1][-1]["pid"]:
            runs.append([])
        runs[-1].append(record)
    return runs


def test_sigkill_then_resume_trains_every_prompt_once(cli, private_server, tmp_path):
    out = tmp_path / "run"
    base = ["train", "--env", "words", "--output-dir", str(out),
            "--vllm-url", private_server.base_url,
            "--set", "max_completion_length=16", "--set", "num_generations=4",
            "--set", "save_steps=3", "--set", "gradient_checkpointing=false",
            "--set", "optim=adamw_torch", "--set", "learning_rate=0.0",  # never saturates
            "--set", "token_budget=1024"]  # steps of ~50 samples (the server allows 4096 tokens)
    first = cli.start([*base, "--set", "max_steps=50"], tmp_path / "first.log")
    deadline = time.monotonic() + 600
    while not (out / "checkpoint-6").is_dir():
        assert first.poll() is None, tail_of(tmp_path / "first.log")
        assert time.monotonic() < deadline, "no checkpoint-6 within 600 s"
        time.sleep(0.5)
    time.sleep(2.0)  # let it train past the checkpoint, so the killed steps must be redone
    cli.stop(first)

    checkpoint = last_complete_checkpoint(out)  # SIGKILL may have cut the newest save short
    ckpt_step = int(checkpoint.name.split("-")[1])
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    cli.run([*base, "--set", f"max_steps={ckpt_step + 6}",
             "--set", "resume_from_checkpoint=last"], tmp_path / "second.log", timeout=600)

    runs = _ledger_runs(out / "prompt_ledger.jsonl")
    assert len(runs) == 2
    before = [r for r in runs[0] if r["step"] <= ckpt_step]
    assert runs[1][0]["step"] == ckpt_step + 1
    consumed = [i for run in (before, runs[1]) for r in run for i in r["completed"] + r["noticed"]]
    assert len(consumed) == len(set(consumed)), "a prompt was trained twice"
    assert before[-1]["frontier"] == state["first_untrained_prompt_index"]
    final_frontier = runs[1][-1]["frontier"]
    assert final_frontier > state["first_untrained_prompt_index"]
    assert set(range(final_frontier)) <= set(consumed), "a prompt below the resume point was lost"



def test_lora_rank_flag_trains_an_adapter_and_syncs_it_as_an_adapter(cli, tmp_path):
    """Embedded server started with --enable-lora; the adapter, not merged weights, is pushed."""
    out = tmp_path / "lora"
    args = ["train", "--env", "words", "--output-dir", str(out), "--lora-rank", "8"]
    for item in ["max_steps=3", "learning_rate=0.001", "num_generations=4",
                 "max_completion_length=16", "optim=adamw_torch", "save_strategy=no"]:
        args += ["--set", item]
    cli.run(args, tmp_path / "cli.log", timeout=900)

    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)
    assert not (out / "final" / "model.safetensors").exists()  # the adapter alone was saved
    # Adapter versions are written here for the server to load, and removed when the run ends.
    assert (out / ".vllm_lora").is_dir() and list((out / ".vllm_lora").iterdir()) == []
    syncs = [r for r in read_jsonl(out / "metrics.jsonl") if "perf/weight_sync_s" in r]
    assert syncs and all(r["perf/weight_sync_pause_s"] == 0.0 for r in syncs)


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (a child in its own session is still a child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_run_with_its_managed_server_and_worker(cli, tmp_path):
    """`kill PID` on the CLI alone (not its group) must not leave the vLLM server running."""
    out = tmp_path / "term"
    proc = cli.start(["train", "--env", "words", "--output-dir", str(out), "--set", "max_steps=500",
                      "--set", "save_strategy=no", "--set", "max_completion_length=16"],
                     tmp_path / "cli.log")
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            assert proc.poll() is None, tail_of(tmp_path / "cli.log")
            time.sleep(1)
        assert (out / "metrics.jsonl").is_file(), tail_of(tmp_path / "cli.log")
        below = _descendants(proc.pid)
        assert len(below) >= 2, below  # at least the server and the rollout worker
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(1)
        assert not [pid for pid in below if _alive(pid)], tail_of(tmp_path / "cli.log")
    finally:
        cli.stop(proc)
        for pid in below:  # a failed run must not leak its server (it has its own session)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)

def test_trainer_with_tools_runs_the_agent_path(private_server, tiny_model_path, tmp_path):
    script = Path(__file__).with_name("quickstart") / "train_with_tools.py"
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_path), private_server.base_url, str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    logs = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(logs) == 3
    for name in ("tools/call_frequency", "tools/loop_exhausted_frac", "rollout/turns_mean"):
        assert any(name in r for r in logs), name


def tail_of(path: Path) -> str:
    return path.read_text(errors="replace")[-6000:] if path.exists() else "(no log)"
